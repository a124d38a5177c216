"""The workshop's JupyterHub (tools/hub): jupyterhub_config.py, site.toml, batch_script.sh; rehearsal.py is `make hub`."""
