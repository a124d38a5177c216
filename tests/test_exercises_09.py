"""09_sharded_training's exercises: each checker accepts the package's solution and another correct answer, and
rejects the notebook's unedited skeleton and another plausible mistake, saying what is wrong."""
from __future__ import annotations

from answers import defined
from conftest import skeleton as notebook_skeleton

from tutorial.lessons import sharded as lesson


def skeleton(heading: str):
    return notebook_skeleton("09_sharded_training", heading)


def test_exercise_1_bytes_per_parameter(capsys):
    assert lesson.check_bytes_per_parameter(lesson.zero_bytes_per_parameter)
    assert not lesson.check_bytes_per_parameter(skeleton("### Exercise 1"))
    assert "stage 1, 2 ranks: you have 9 bytes per parameter, expected 10" in capsys.readouterr().out


def test_exercise_1_accepts_a_table_and_names_stage_3_keeping_whole_weights(capsys):
    table = defined(
        "def my_bytes_per_parameter(stage, world_size):\n"
        "    sharded = {0: (), 1: ('optimizer',), 2: ('optimizer', 'grads'), 3: ('optimizer', 'grads', 'weights')}\n"
        "    size = {'weights': 2, 'grads': 2, 'optimizer': 12}\n"
        "    return sum(b / world_size if k in sharded[stage] else b for k, b in size.items())\n")
    assert lesson.check_bytes_per_parameter(table)
    no_weights = defined(
        "def my_bytes_per_parameter(stage, world_size):\n"
        "    weights, grads, optimizer = 2, 2, 12\n"
        "    if stage >= 1:\n"
        "        optimizer /= world_size\n"
        "    if stage >= 2:\n"
        "        grads /= world_size\n"
        "    return weights + grads + optimizer\n")
    assert not lesson.check_bytes_per_parameter(no_weights)
    assert "stage 3, 2 ranks" in capsys.readouterr().out


def test_exercise_2_accepts_the_solution_and_names_the_missing_root(cluster):
    assert cluster.run(lesson.check_fully_shard, lesson.fully_shard_solution)["ok"]
    cluster.view.execute("import torch", block=True)  # the skeleton uses the notebook's engines' `import torch`
    checked = cluster.run(lesson.check_fully_shard, skeleton("### Exercise 2"))
    assert not checked["ok"] and checked["problems"][0].startswith("the root is not sharded"), checked


def test_exercise_2_names_sharding_only_the_root(cluster):
    root_only = defined(
        "def my_shard(model):\n"
        "    from torch.distributed.fsdp import fully_shard\n"
        "    fully_shard(model)\n"
        "    return model\n")
    checked = cluster.run(lesson.check_fully_shard, root_only)
    assert not checked["ok"] and len(checked["problems"]) == 1, checked
    assert checked["problems"][0].startswith("the whole model is one FSDP unit"), checked


def test_exercise_2_accepts_every_linear_found_by_type(cluster):
    by_type = defined(
        "def my_shard(model):\n"
        "    import torch\n"
        "    from torch.distributed.fsdp import fully_shard\n"
        "    for module in model.modules():\n"
        "        if isinstance(module, torch.nn.Linear):\n"
        "            fully_shard(module, reshard_after_forward=True)\n"
        "    fully_shard(model)\n")
    checked = cluster.run(lesson.check_fully_shard, by_type)
    assert checked["ok"], checked


def test_exercise_3_accepts_the_solution_and_names_the_reentrant_checkpoint(capsys):
    assert lesson.check_checkpointing(lesson.checkpoint_solution)
    capsys.readouterr()
    # the skeleton's reentrant wrapper: the data into block 0 does not require grad, so the loss has no graph
    unedited = notebook_skeleton("09_sharded_training", "### Exercise 3", "my_checkpointing")
    assert not lesson.check_checkpointing(unedited)
    out = capsys.readouterr().out
    assert "a reentrant checkpoint" in out and "use_reentrant=False" in out, out


def test_exercise_3_accepts_a_module_that_calls_checkpoint():
    """A second, differently written answer: the blocks inside a module of one's own whose forward checkpoints."""
    by_hand = defined(
        "import torch\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "class Each(torch.nn.Module):\n"
        "    def __init__(self, blocks):\n"
        "        super().__init__()\n"
        "        self.blocks = blocks\n"
        "    def forward(self, x):\n"
        "        for b in self.blocks:\n"
        "            x = checkpoint(b, x, use_reentrant=False)\n"
        "        return x\n"
        "def my_checkpointing(model):\n"
        "    return Each(model)\n", "my_checkpointing")
    assert lesson.check_checkpointing(by_hand)


def test_exercise_3_names_the_whole_model_as_one_checkpoint(capsys):
    whole = defined(
        "def my_checkpointing(model):\n"
        "    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper\n"
        "    return checkpoint_wrapper(model)\n")
    assert not lesson.check_checkpointing(whole)
    assert "recomputed 4 blocks at once" in capsys.readouterr().out


def test_exercise_3_names_blocks_left_unwrapped(capsys):
    """Negative controls: the model returned as it came, and only its last block wrapped."""
    assert not lesson.check_checkpointing(lambda model: model)
    assert "not every block is checkpointed" in capsys.readouterr().out
    last_only = defined(
        "def my_checkpointing(model):\n"
        "    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper\n"
        "    model[3] = checkpoint_wrapper(model[3])\n"
        "    return model\n")
    assert not lesson.check_checkpointing(last_only)
    assert "not every block is checkpointed" in capsys.readouterr().out


def test_activation_memory_counts_saved_tensors_not_parameters():
    """What the notebook measures: without checkpointing nothing is recomputed and every block's insides are
    saved; with a checkpoint per block the saved bytes are the blocks' inputs and the output (5 tensors of 64 x 512
    fp32 here) and one block is recomputed at a time."""
    import torch
    X = torch.randn(64, 512)
    plain = lesson.activation_memory(lesson.mlp_blocks(), X)
    assert plain["at_once"] == 0 and plain["peak_bytes"] is None
    model = lesson.checkpoint_solution(lesson.mlp_blocks())
    ckpt = lesson.activation_memory(model, X, [m._checkpoint_wrapped_module for m in model])
    assert ckpt["saved_bytes"] == 5 * 64 * 512 * 4 and ckpt["at_once"] == 1
    assert plain["saved_bytes"] > 5 * ckpt["saved_bytes"]
    assert all(torch.allclose(ckpt["grads"][n], g, atol=1e-6) for n, g in plain["grads"].items())
