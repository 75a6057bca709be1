"""One owner of data-parallel reduction: ``colfunc/transforms/data_parallel``.

Read from the source, so that a second owner cannot come back unnoticed:

- no module of ``colfunc/transforms`` outside the owner names a gradient-reduction primitive
  (the buckets, the packed all-reduce and reduce-scatter, the async starts) or hands something
  named like a gradient to a reducing collective;
- :class:`~colfunc.transforms.composition.Composition` has no boolean about what another
  transform reduces: the decision is one :class:`~colfunc.transforms.data_parallel.Reduction`;
- ``offload`` has no data-parallel code of its own: no batch split, no loss mean, no collective.

And from the step: the reduction is data, per leaf (the axes each parameter is reduced over,
none for a frozen one), chosen when the composition is built.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

import colfunc as cf
from colfunc import optim
from colfunc.models import gpt
from colfunc.transforms.composition import Composition
from colfunc.transforms.data_parallel import LeafReduction, Reduction

ROOT = pathlib.Path(cf.__file__).parent / "transforms"
OWNER = ROOT / "data_parallel"
# the gradient-reduction primitives of the owner: none may be named outside it
PRIMITIVES = {
    "GradBuckets",
    "ScatterBuckets",
    "PackedBuckets",
    "all_reduce_tree",
    "all_reduce_buckets",
    "reduce_scatter_flat",
    "finish_buckets",
    "average_grads",
}
REDUCING = {"all_reduce", "all_reduce_async", "reduce_scatter", "reduce_scatter_async"}


def _modules(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*.py") if OWNER not in p.parents)


def _names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def test_the_owner_is_where_the_primitives_live() -> None:
    defined = set()
    for path in OWNER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
    missing = (PRIMITIVES - {"average_grads"}) - defined
    assert not missing, f"not defined by the owner: {missing}"


@pytest.mark.parametrize("path", _modules(ROOT), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_other_transform_reduces_gradients(path: pathlib.Path) -> None:
    tree_ = ast.parse(path.read_text())
    named = _names(tree_) & PRIMITIVES
    assert not named, f"{path.name} names the gradient-reduction primitives {sorted(named)}"
    for node in ast.walk(tree_):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        if name not in REDUCING:
            continue
        args = set().union(*(_names(a) for a in [*node.args, *(k.value for k in node.keywords)]))
        grads = sorted(a for a in args if "grad" in a.lower())
        assert not grads, (
            f"{path.name}:{node.lineno} hands {grads} to {name}: a gradient reduction outside "
            f"colfunc/transforms/data_parallel"
        )


def test_composition_has_no_boolean_about_another_transforms_reduction() -> None:
    for gone in ("zero_reduces", "reduce_in_backward", "overlaps_update", "offload_fetches"):
        assert not hasattr(Composition, gone), gone
    for name, member in inspect.getmembers(Composition):
        if isinstance(member, property):
            ret = inspect.signature(member.fget).return_annotation
            assert ret not in (bool, "bool"), f"Composition.{name} is a boolean"
    assert "reduction" in dir(Composition)


def test_offload_has_no_data_parallel_code_of_its_own() -> None:
    for path in sorted((ROOT / "offload").glob("*.py")):
        src = path.read_text()
        # its own names (what it calls through the composition's reduction is the owner's)
        names = {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
        assert not names & {"split_batch", "DataParallel", *REDUCING}, path.name
        assert "comm." not in src, f"{path.name} calls a collective of its own"


def _loss() -> tuple[object, dict]:
    cfg = gpt.Config(vocab_size=32, n_layer=2, n_head=2, d_model=8, max_seq_len=8)
    return gpt.loss(cfg), gpt.init(cfg, seed=0)


@pytest.mark.parametrize(
    ("stage", "mode"),
    [
        (None, "all_reduce"),
        (0, "all_reduce"),
        (1, "reduce_scatter"),
        (2, "reduce_scatter"),
        (3, "gather"),
    ],
)
def test_the_reduction_is_decided_once_per_leaf(stage, mode) -> None:
    loss_fn, params = _loss()
    mesh = cf.Mesh({"dp": 2}, 0)
    step = cf.train_step(loss_fn, optim.adamw(1e-3), trainable="blocks.*")
    step = cf.shard(step, mesh)
    if stage is not None:
        step = cf.zero(step, stage)
    red = step.composition.reduction
    assert isinstance(red, Reduction)
    assert (red.mode, red.axis, red.split, red.when) == (mode, "dp", "dp", "backward")
    leaves = red.leaves(step, params)
    assert set(leaves) == set(cf.tree.paths(params))
    for path, leaf in leaves.items():
        want = ("dp",) if path.startswith("blocks.") else ()
        assert leaf == LeafReduction(want, mode), path
    # the same decision whatever order the transforms were applied in
    if stage is not None:
        other = cf.shard(
            cf.zero(cf.train_step(loss_fn, optim.adamw(1e-3), trainable="blocks.*"), stage), mesh
        )
        assert other.composition.reduction == red


def test_pipeline_beneath_reduces_in_sync_and_no_axis_means_no_reduction() -> None:
    loss_fn, _ = _loss()
    mesh = cf.Mesh({"dp": 2, "pp": 2}, 0)
    base = cf.train_step(loss_fn, optim.sgd(0.1))
    assert base.composition is None or base.composition.reduction is None
    assert cf.remat(base).composition.reduction is None
    piped = cf.shard(cf.pipeline(base, stages=2, microbatches=2), mesh)
    assert piped.composition.reduction.when == "sync"
    after = cf.shard(base, cf.Mesh({"dp": 2}, 0), overlap=False)
    assert after.composition.reduction.when == "after"
