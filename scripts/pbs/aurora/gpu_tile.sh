#!/bin/bash
# One tile per rank on Aurora: PALS's mpiexec starts this once per rank (scripts/pbs/aurora/ddp.sh), and it starts
# the command with ZE_AFFINITY_MASK naming one tile, GPU.tile, so the rank sees that tile alone, as xpu:0.
# Local ranks 0 and 1 share GPU 0 (tiles 0.0, 0.1), ..., 10 and 11 GPU 5 (5.0, 5.1): neighbouring ranks, whose cores
# sit on the same socket (ddp.sh's --cpu-bind list), share a card. ALCF's gpu_tile_compact.sh does the same.
#   mpiexec -n 24 --ppn 12 ... scripts/pbs/aurora/gpu_tile.sh python -m tutorial.train_ddp ...
set -eu
if [[ ! ${PALS_LOCAL_RANKID:-} =~ ^[0-9]+$ ]]; then
  echo "PALS_LOCAL_RANKID='${PALS_LOCAL_RANKID:-}' is not a local rank: start gpu_tile.sh with PALS's mpiexec" >&2
  exit 2
fi
GPUS=6
TILES=2
if (( PALS_LOCAL_RANKID >= GPUS * TILES )); then
  echo "local rank $PALS_LOCAL_RANKID has no tile of its own: a node has $((GPUS * TILES)); use --ppn 12 or fewer" >&2
  exit 2
fi
# GPU.tile names a tile in Level Zero's COMPOSITE hierarchy (each card one device of 2 tiles), which is set here:
# Aurora's default is FLAT (each tile a device, 0-11), where "0.1" would name a tile of a device that has none. Where
# you chose FLAT yourself (ZE_FLAT_DEVICE_HIERARCHY=FLAT), the same tile is device $PALS_LOCAL_RANKID. Either way
# the rank sees one device.
if [[ ${ZE_FLAT_DEVICE_HIERARCHY:-} == FLAT ]]; then
  export ZE_AFFINITY_MASK=$PALS_LOCAL_RANKID
else
  export ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE
  export ZE_AFFINITY_MASK=$((PALS_LOCAL_RANKID / TILES)).$((PALS_LOCAL_RANKID % TILES))
fi
exec "$@"
