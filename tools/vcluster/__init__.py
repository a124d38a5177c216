"""Virtual nodes: a real multi-node cluster on one Linux machine, for rehearsing a workshop and for the tests of
notebook 06. A root-only tool of the repository, deliberately not part of the installed `tutorial` package: it creates
network namespaces, writes /etc/netns/*, starts Slurm's daemons and (only when asked: `install`) runs apt-get.

    scripts/virtual_cluster.sh up 2 [--slurm]   # node1, node2: 10.77.0.1 and 10.77.0.2 on one switch
    scripts/virtual_cluster.sh exec node2 CMD   # run CMD "on" node2
    scripts/virtual_cluster.sh install          # apt-get install slurm-wlm munge nftables (once per machine)
    scripts/virtual_cluster.sh slurm up         # munge, slurmctld on node1, slurmd on every node
    scripts/virtual_cluster.sh down             # remove everything (idempotent, also after a crash)

`vcluster.nodes` makes the nodes (namespaces, addresses, host names, the lock), `vcluster.slurm` runs Slurm on them,
`vcluster.cluster` takes both up and down together, `python -m vcluster` is the command line. Python code outside this folder (tests/test_virtual_cluster.py,
tutorial.lessons.multi_node) imports it by its path in the checkout.

Up to the root check the tool needs only the standard library, so a user who is not root gets one line saying so
from any Python; the rest uses psutil and filelock from the project's virtual environment.
"""
