"""06_multi_node's exercises: each checker accepts the package's solution and rejects the notebook's unedited skeleton
naming the mistakes (no process is started: the checkers read the command and the batch script)."""
from conftest import skeleton as notebook_skeleton
from tutorial.lessons import multi_node as lesson


def skeleton(heading: str):
    return notebook_skeleton("06_multi_node", heading)


def test_exercise_1_checker_accepts_the_solution_and_names_both_mistakes():
    assert lesson.check_torchrun_node(lesson.solution_torchrun_node) == \
        "correct: 2 nodes x 4 processes = 8 ranks, this one is node 1, rank 0 at 10.0.0.1:29500"
    verdict = lesson.check_torchrun_node(skeleton("### Exercise 1"))
    assert verdict.startswith("wrong: --nproc_per_node 8: it counts the processes on *this* node"), verdict
    assert "on node 1, localhost is node 1 itself" in verdict


def test_exercise_1_checker_accepts_c10d_and_rejects_a_repeated_node_rank():
    c10d = ["torchrun", "--nnodes", "2", "--nproc_per_node", "4", "--rdzv_backend", "c10d",
            "--rdzv_endpoint", "10.0.0.1:29500", "--rdzv_id", "42", "-m", "tutorial.train_ddp"]
    assert lesson.check_torchrun_node(lambda: c10d).startswith("correct: ")
    node0 = [w if w != "1" else "0" for w in lesson.solution_torchrun_node()]
    assert "--node_rank 0: the second node is node 1" in lesson.check_torchrun_node(lambda: node0)


def test_exercise_2_checker_accepts_the_solution_and_names_both_wrong_lines():
    assert lesson.check_sbatch(lesson.solution_ddp_sbatch).startswith("correct: 2 nodes, one torchrun per node")
    verdict = lesson.check_sbatch(skeleton("### Exercise 2"))
    assert verdict.startswith("wrong: line 4 `#SBATCH --ntasks-per-node=4`: srun starts that many torchruns"), verdict
    assert "line 8 `srun torchrun" in verdict and "rendezvous at localhost:29500" in verdict


def test_exercise_2_checker_names_the_loopback_interface():
    script = lesson.solution_ddp_sbatch().replace("head=", "export NCCL_SOCKET_IFNAME=lo\nhead=")
    assert "`export NCCL_SOCKET_IFNAME=lo`: lo is the loopback interface" in lesson.check_sbatch(lambda: script)


def test_exercise_1_accepts_hyphens_and_equals_and_names_the_world_size():
    hyphens = ["torchrun", "--nnodes=2", "--nproc-per-node=4", "--node-rank=1", "--master-addr=10.0.0.1",
               "--master-port=29500", "-m", "tutorial.train_ddp", "--preset", "workshop"]
    assert lesson.check_torchrun_node(lambda: hyphens).startswith("correct: ")
    world = [w if w != "4" else "8" for w in lesson.solution_torchrun_node()]
    assert "--nproc_per_node 8: it counts the processes on *this* node" in lesson.check_torchrun_node(lambda: world)


SBATCH = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
{setup}
srun torchrun --nnodes 2 {nproc} --rdzv_backend c10d {endpoint} --rdzv_id "$SLURM_JOB_ID" \\
    -m tutorial.train_ddp --preset workshop
"""


def sbatch(setup="", nproc="--nproc_per_node 4", endpoint='--rdzv_endpoint "$head:29500"'):
    text = SBATCH.format(setup=setup, nproc=nproc, endpoint=endpoint)
    return lambda: text


HEAD = 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'


def test_exercise_2_accepts_the_spellings_torchrun_accepts():
    correct = "correct: 2 nodes, one torchrun per node"
    for nproc in ("--nproc-per-node=4", "--nproc_per_node=4", "--nproc-per-node $SLURM_GPUS_ON_NODE",
                  "--nproc_per_node gpu"):
        assert lesson.check_sbatch(sbatch(HEAD, nproc=nproc)).startswith(correct), nproc
    for endpoint in ('--rdzv_endpoint="$head:29500"', "--rdzv-endpoint=${head}:29500"):
        assert lesson.check_sbatch(sbatch(HEAD, endpoint=endpoint)).startswith(correct), endpoint
    exported = 'export MASTER_ADDR=$(scontrol show hostname "$SLURM_NODELIST" | head -n1)'
    assert lesson.check_sbatch(sbatch(exported, endpoint='--rdzv-endpoint "$MASTER_ADDR:29500"')).startswith(correct)
    launch_node = '--rdzv_endpoint "$SLURM_LAUNCH_NODE_IPADDR:29500"'
    assert lesson.check_sbatch(sbatch("", endpoint=launch_node)).startswith(correct)


def test_exercise_2_rejects_an_endpoint_that_names_each_node_itself():
    for endpoint, why in (('--rdzv_endpoint "$(hostname):29500"', "runs on every node and gives that node's own"),
                          ("--rdzv_endpoint=$SLURMD_NODENAME:29500", "differs from node to node"),
                          ('--rdzv_endpoint "$MASTER_ADDR:29500"', "$MASTER_ADDR is set nowhere in the script"),
                          ("--rdzv_endpoint 127.0.0.1:29500", "every node's torchrun would meet itself")):
        verdict = lesson.check_sbatch(sbatch("", endpoint=endpoint))
        assert verdict.startswith("wrong: line 6 `srun torchrun") and why in verdict, verdict
    verdict = lesson.check_sbatch(sbatch(HEAD, nproc="--nproc-per-node=8"))
    assert verdict == "wrong: line 6: --nproc_per_node 8 should be 4, one per GPU"


def test_exercise_2_accepts_a_static_rendezvous_with_slurms_node_id_only():
    static = SBATCH.format(setup=HEAD, nproc="--nproc_per_node 4", endpoint="").replace(
        "--rdzv_backend c10d", '--node_rank "$SLURM_NODEID" --master_addr "$head" --master_port 29500')
    assert lesson.check_sbatch(lambda: static).startswith("correct: 2 nodes, one torchrun per node")
    same_rank = static.replace('"$SLURM_NODEID"', "0")
    assert "every node needs its own --node_rank" in lesson.check_sbatch(lambda: same_rank)


def test_exercise_2_rules_are_pure_functions_reported_in_the_tables_order():
    """check_sbatch is a table of rules, as check-ddp's findings are: each reads only the script as read once, so it
    can be called alone, and a verdict names the problems in the table's order, not the script's."""
    right = lesson._read_sbatch(lesson.solution_ddp_sbatch())
    assert [rule(right) for rule in lesson._SBATCH_RULES] == [None] * len(lesson._SBATCH_RULES)
    text = sbatch("export NCCL_SOCKET_IFNAME=lo\n" + HEAD, nproc="--nproc_per_node 8")()
    script = lesson._read_sbatch(text)
    before = repr(script)
    found = {rule.__name__: rule(script) for rule in reversed(lesson._SBATCH_RULES)}  # called alone, in any order
    assert repr(script) == before and found == {rule.__name__: rule(script) for rule in lesson._SBATCH_RULES}
    problems = [found[rule.__name__] for rule in lesson._SBATCH_RULES if found[rule.__name__]]
    assert [name for name, problem in found.items() if problem] == ["_no_loopback", "_one_process_per_gpu"]
    assert problems[0].startswith("line 7: --nproc_per_node 8") and problems[1].startswith("line 5 `export NCCL")
    assert lesson.check_sbatch(lambda: text) == "wrong: " + "; ".join(problems)
