"""The workshop's JupyterHub: jupyterhub_config.py, site.toml and batch_script.sh; rehearsal.py is `make hub`."""
