"""The course's JupyterLab defaults, for every lab that runs from this venv: `make lab` (scripts/lab.sh) and the
workshop's hub (tools/hub) write them before they start. JupyterLab reads overrides.json in
<prefix>/share/jupyter/lab/settings as the defaults of this venv's lab (a person's own settings still win). Our keys
are merged into whatever else is there.

TensorBoard in the lab: jupyter-server-proxy starts it at the first visit of <lab URL>/tensorboard/ (a launcher
tile too), on the lab's runs/ folder (or $TUTORIAL_RUNS), where the notebooks' trainers write their event files. The
URL is behind the lab's own login (under a hub, /user/<name>/tensorboard/ refuses other attendees); TensorBoard
itself listens on 127.0.0.1 without a login, as any TensorBoard a user starts does, so on a node shared by several
attendees the others could read its plots, never the lab: the proxy hands it no cookie and no token. Its setting is
Python (a command computed at start) in <prefix>/etc/jupyter/jupyter_server_config.py, written only where that file is
ours or absent, and added to a site's own proxied servers, not in their place.

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

# TensorBoard on the lab's runs/ (the root the lab serves, known only once it starts), under the lab's URL
# (--path_prefix: TensorBoard's own links then carry the prefix the proxy passes on, absolute_url).
SERVER_CONFIG = """# Written by the course's scripts/lab_settings.py: TensorBoard beside the lab (jupyter-server-proxy).


def _tensorboard(port, base_url):
    import os
    import sys

    from jupyter_server.serverapp import ServerApp

    # where the notebooks put their runs (notebook.runs_dir): runs/ beside them, or TUTORIAL_RUNS
    runs = os.path.join(ServerApp.instance().root_dir, os.environ.get("TUTORIAL_RUNS") or "runs")
    return [sys.executable, "-m", "tensorboard.main", "--logdir", runs, "--host", "127.0.0.1", "--port", str(port),
            "--path_prefix", base_url.rstrip("/") + "/tensorboard", "--reload_interval", "15"]


c.ServerProxy.servers.update({  # beside a site's own
    "tensorboard": {
        "command": _tensorboard,
        "absolute_url": True,
        "timeout": 60,  # its first start imports a lot
        "launcher_entry": {"title": "TensorBoard (runs/)", "category": "Other"},
        "new_browser_tab": False,
        # the attendee's login stays with the lab: TensorBoard, reachable by anyone on this node, never sees it
        "request_headers_override": {"Cookie": "", "Authorization": ""},
    },
})
"""
server = pathlib.Path(sys.argv[1], "etc", "jupyter", "jupyter_server_config.py")
if not server.is_file() or server.read_text().startswith("# Written by the course's"):
    server.parent.mkdir(parents=True, exist_ok=True)
    server.write_text(SERVER_CONFIG)
else:
    print(f"lab settings: {server} is not ours: TensorBoard is not added to the lab (add the course's setting to it "
          "by hand: scripts/lab_settings.py SERVER_CONFIG)")
