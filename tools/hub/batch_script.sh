#!/bin/bash
# One attendee's JupyterLab as a Slurm job: the template batchspawner fills in for each spawn (Jinja; the values come
# from tools/hub/site.toml through jupyterhub_config.py). The hub submits it as the attendee (site.toml's submit_as).
#SBATCH --job-name=workbook-lab
#SBATCH --output={{homedir}}/.workbook-lab-%j.log
#SBATCH --chdir={{homedir}}
#SBATCH --export={{keepvars}}
#SBATCH --nodes=1
#SBATCH --ntasks=1
# A lab is not restartable: Slurm's default (JobRequeue=1) puts a batch job whose node fails back in the queue,
# where the hub's poll reads it as alive and keeps sending the attendee to a lab that is gone. Not requeued, the
# job ends as NODE_FAIL, the hub notices, and the attendee's page offers a new lab.
#SBATCH --no-requeue
{% if partition %}#SBATCH --partition={{partition}}
{% endif %}{% if account %}#SBATCH --account={{account}}
{% endif %}{% if reservation %}#SBATCH --reservation={{reservation}}
{% endif %}{% if qos %}#SBATCH --qos={{qos}}
{% endif %}{% if runtime %}#SBATCH --time={{runtime}}
{% endif %}{% if nprocs %}#SBATCH --cpus-per-task={{nprocs}}
{% endif %}{% if gres %}#SBATCH --gres={{gres}}
{% endif %}{% if memory %}#SBATCH --mem={{memory}}
{% endif %}{% for option in options.split() %}#SBATCH {{option}}
{% endfor %}
set -euo pipefail
# The shared environment, read-only: the instructor's venv (its `tutorial` kernel) and the course's commands
# (end-my-session); nothing is installed for the attendee.
export PATH="{{venv}}/bin:{{course}}/tools/hub/bin:$PATH"
export TUTORIAL_DATA_DIR="{{data_dir}}"
# The attendee's own copy of the notebooks, made at the first start; later starts add only notebooks that are new,
# so an attendee's edits stay theirs.
mkdir -p "$HOME/{{workbook}}"
cp -r --no-clobber "{{course}}/notebooks/." "$HOME/{{workbook}}/"
echo "workbook-lab: job $SLURM_JOB_ID on $(hostname), GPUs ${CUDA_VISIBLE_DEVICES-none}, user $(id -un)"
{{cmd}}
