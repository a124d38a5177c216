"""11_model_parallelism's exercises: each checker accepts the package's solution and another correct answer, and
rejects the skeleton and another plausible mistake, saying what is wrong. The skeletons are the lesson module's
SKELETONS, which the notebook's exercise cells hold."""
from __future__ import annotations

import pytest
from answers import defined
from conftest import ROOT, exercise_cell

from tutorial.lessons import model_parallel as lesson

NOTEBOOK = "11_model_parallelism"
HEADINGS = {"tp": "### Exercise 1", "pp": "### Exercise 2", "2d": "### Exercise 3", "ddp": "### Exercise 4"}


def skeleton(name: str):
    return defined(lesson.SKELETONS[name])


@pytest.mark.parametrize("name", list(HEADINGS))
def test_the_notebook_holds_the_skeletons(name):
    assert exercise_cell(NOTEBOOK, HEADINGS[name]).strip() == lesson.SKELETONS[name].strip()


# Exercise 1: a row-wise layer placed column-wise
def test_exercise_1_mlp_plan(cluster):
    assert lesson.check_mlp_plan(cluster, lesson.solution_mlp_plan).startswith("correct: output and gradients")
    verdict = lesson.check_mlp_plan(cluster, skeleton("tp"))
    assert verdict.startswith("wrong: rank 0 failed (RuntimeError") and "RowwiseParallel" in verdict, verdict


def test_exercise_1_accepts_explicit_layouts_and_names_gathered_activations(cluster):
    explicit = defined(
        "def mlp_plan():\n"
        "    from torch.distributed.tensor import Replicate, Shard\n"
        "    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel\n"
        "    return {'fc': ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1)),\n"
        "            'proj': RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())}\n")
    assert lesson.check_mlp_plan(cluster, explicit).startswith("correct: output and gradients")
    gathered = defined(
        "def mlp_plan():\n"
        "    from torch.distributed.tensor import Replicate\n"
        "    from torch.distributed.tensor.parallel import ColwiseParallel\n"
        "    return {'fc': ColwiseParallel(output_layouts=Replicate()),\n"
        "            'proj': ColwiseParallel(output_layouts=Replicate())}\n")
    verdict = lesson.check_mlp_plan(cluster, gathered)
    assert verdict.startswith("wrong: the output is right, but the forward communicates (all_gather"), verdict
    nothing = defined("def mlp_plan():\n    return {}\n")
    assert lesson.check_mlp_plan(cluster, nothing).startswith("wrong: every rank holds the whole fc.weight")


# Exercise 2: a micro-batch count that does not divide the batch
def test_exercise_2_micro_batches(cluster):
    assert lesson.check_schedule(cluster, lesson.solution_make_schedule).startswith("correct: 8 micro-batches of 2")
    verdict = lesson.check_schedule(cluster, skeleton("pp"))
    assert verdict.startswith("wrong: 6 micro-batches do not divide the batch of 16"), verdict


def test_exercise_2_accepts_1f1b_and_names_a_large_bubble_and_unscaled_gradients(cluster):
    one_f_one_b = defined(
        "def make_schedule(stage, batch_size, loss_fn):\n"
        "    from torch.distributed.pipelining import Schedule1F1B\n"
        "    return Schedule1F1B(stage, batch_size, loss_fn=loss_fn)  # micro-batches of one sequence\n")
    assert lesson.check_schedule(cluster, one_f_one_b).startswith("correct: 16 micro-batches of 1")
    four = defined(lesson.SKELETONS["pp"].replace("n_microbatches = 6", "n_microbatches = 4"))
    verdict = lesson.check_schedule(cluster, four)
    assert verdict.startswith("wrong: right gradients, but with 4 micro-batches on 2 stages each stage is idle"), \
        verdict
    unscaled = defined(lesson.SKELETONS["pp"].replace("n_microbatches = 6", "n_microbatches = 8")
                       .replace("loss_fn=loss_fn)", "loss_fn=loss_fn, scale_grads=False)"))
    verdict = lesson.check_schedule(cluster, unscaled)
    assert verdict.startswith("wrong: the gradients differ") and "about 8 times" in verdict, verdict


# Exercise 3: the mesh's dimensions mixed up (4 ranks simulated in this process: layouts only)
def test_exercise_3_mesh():
    assert lesson.check_mesh(lesson.solution_parallelize_2d).startswith("correct: TP pairs (0, 1) and (2, 3)")
    verdict = lesson.check_mesh(skeleton("2d"))
    assert verdict.startswith("wrong: the tensor-parallel pairs are ranks [(0, 2), (1, 3)], not") and \
        "mesh_dim_names=('dp', 'tp')" in verdict, verdict


def test_exercise_3_accepts_other_names_and_names_swapped_calls_and_a_missing_fsdp():
    other = defined(
        "def parallelize_2d(model, plan):\n"
        "    import torch.distributed as dist\n"
        "    from torch.distributed.device_mesh import init_device_mesh\n"
        "    from torch.distributed.fsdp import fully_shard\n"
        "    from torch.distributed.tensor.parallel import parallelize_module\n"
        "    mesh = init_device_mesh('cpu', (dist.get_world_size() // 2, 2), mesh_dim_names=('data', 'model'))\n"
        "    parallelize_module(model, mesh['model'], plan)\n"
        "    for block in model.blocks.values():\n"
        "        fully_shard(block, mesh=mesh['data'])\n"
        "    fully_shard(model, mesh=mesh['data'])\n"
        "    return mesh\n")
    assert lesson.check_mesh(other).startswith("correct: TP pairs (0, 1) and (2, 3)")
    fixed_names = lesson.SKELETONS["2d"].replace('("tp", "dp")', '("dp", "tp")')
    swapped = defined(fixed_names.replace('mesh["tp"], plan', 'mesh["dp"], plan')
                      .replace('mesh=mesh["dp"]', 'mesh=mesh["tp"]'))
    assert lesson.check_mesh(swapped).startswith("wrong: the tensor-parallel pairs are ranks [(0, 2), (1, 3)]: the "
                                                 "TP plan went onto mesh['dp']")
    tp_only = defined(fixed_names.split("    for block")[0] + "    return mesh\n")
    assert lesson.check_mesh(tp_only).startswith("wrong: q's weight is cut over 1 mesh dimension")


# Exercise 4: DDP by hand
def test_exercise_4_bucketed_ddp(cluster):
    verdict = lesson.check_bucketed_ddp(cluster, lesson.solution_BucketedDDP)
    assert verdict.startswith("correct: DDP's gradients, from 4 bucketed all-reduces for 8 parameters"), verdict
    verdict = lesson.check_bucketed_ddp(cluster, skeleton("ddp"))
    assert verdict.startswith("wrong: the gradients are 2 times DDP's"), verdict


HOOKED = '''
class BucketedDDP:
    def __init__(self, model, params_per_bucket=2):
        import torch.distributed as dist
        self.model, self.works = model, []
        params = list(model.parameters())[::-1]
        self.buckets = [params[i:i + params_per_bucket] for i in range(0, len(params), params_per_bucket)]
        self.left = {}
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self.arrived(i))

    def arrived(self, i):
        import torch, torch.distributed as dist
        self.left[i] = self.left.get(i, len(self.buckets[i])) - 1
        if self.left[i] == 0:
            del self.left[i]
            flat = torch.cat([p.grad.flatten() for p in self.buckets[i]]) / dist.get_world_size()
            self.works.append((i, flat, {ASYNC}))

    def finish_gradient_sync(self):
        for i, flat, work in self.works:
            {WAIT}
            for g, part in zip([p.grad for p in self.buckets[i]],
                               flat.split([p.numel() for p in self.buckets[i]])):
                g.copy_(part.view_as(g))
        self.works = []
'''


def test_exercise_4_accepts_dividing_first_and_names_a_late_all_reduce(cluster):
    first = defined(HOOKED.replace("{ASYNC}", "dist.all_reduce(flat, async_op=True)").replace("{WAIT}", "work.wait()"))
    assert lesson.check_bucketed_ddp(cluster, first).startswith("correct: DDP's gradients, from 4 bucketed")
    late = defined(HOOKED.replace("{ASYNC}", "None").replace(
        "{WAIT}", "import torch.distributed as dist; dist.all_reduce(flat)"))
    verdict = lesson.check_bucketed_ddp(cluster, late)
    assert verdict.startswith("wrong: right gradients from 4 all-reduces, but none overlaps backward"), verdict
