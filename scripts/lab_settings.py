"""The course's JupyterLab defaults, for every lab that runs from this venv: `make lab` (scripts/lab.sh) and the
workshop's hub (tools/hub) write them before they start. JupyterLab reads overrides.json in
<prefix>/share/jupyter/lab/settings as the defaults of this venv's lab (a person's own settings still win). Our keys
are merged into whatever else is there.

    python scripts/lab_settings.py VENV
"""
import json
import pathlib
import sys

path = pathlib.Path(sys.argv[1], "share", "jupyter", "lab", "settings", "overrides.json")
settings = json.loads(path.read_text()) if path.is_file() else {}
ours = {
    # "false" is the setting's "Never": no news pop-up, no request to jupyter.org (often offline in a workshop room)
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
    # the notebook's kernel (`tutorial`, in every notebook's metadata) starts without a "Select Kernel" dialog
    "@jupyterlab/notebook-extension:tracker": {"autoStartDefaultKernel": True},
}
for plugin, values in ours.items():
    settings.setdefault(plugin, {}).update(values)
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(settings, indent=2) + "\n")
