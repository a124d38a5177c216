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
