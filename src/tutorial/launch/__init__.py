"""Starting processes and getting rid of them: notebook engines (a thin layer on ipyparallel), launcher commands,
rehearsed nodes. Uses the core and the trainers; never imported by them."""
