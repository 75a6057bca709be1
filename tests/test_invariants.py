"""Grep-able invariants of the package's shape, and the private-PyTorch adapter.

- no file under ``colfunc/transforms/`` imports an underscored name from another file;
- no string-keyed ``options[`` bag is left in the package;
- private PyTorch APIs are used only through ``colfunc.torch_private``, and every entry of it
  resolves on the installed torch (each failing with a message that names it where it does not).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import colfunc as cf
from colfunc import models, optim, torch_private

ROOT = Path(cf.__file__).parent
SOURCES = sorted(ROOT.rglob("*.py"))


def _text(p: Path) -> str:
    return p.read_text(encoding="utf-8")


def test_no_transform_file_imports_an_underscored_name_from_another() -> None:
    pattern = re.compile(r"from\s+colfunc[\w.]*\s+import\s+\(?([^)]*?)\)?$", re.M | re.S)
    offenders = []
    for p in sorted((ROOT / "transforms").rglob("*.py")):
        for m in re.finditer(r"from\s+(colfunc[\w.]*)\s+import\s+(\([^)]*\)|[^\n]*)", _text(p)):
            names = re.findall(r"\b(\w+)\b(?:\s+as\s+\w+)?", m.group(2).strip("()"))
            offenders += [f"{p.name}: {m.group(1)}.{n}" for n in names if n.startswith("_")]
    assert pattern  # the shape of an import, for the reader
    assert offenders == []


def test_no_options_bag_is_left() -> None:
    assert [str(p) for p in SOURCES if "options[" in _text(p) or ".options" in _text(p)] == []


def test_private_torch_is_used_only_through_the_adapter() -> None:
    private = re.compile(
        r"torch\._(?!_)\w+|torch\.utils\._\w+|torch\._C\b|Tensor\._make_wrapper_subclass"
    )
    private_op = re.compile(r"aten\._(?!_)\w+")  # a private ATen op, called or taken
    found = []
    for p in SOURCES:
        if p.name == "torch_private.py":
            continue
        # the propagation rules and their dispatcher key on ATen ops, private ones included
        keyed = "sharding" in p.relative_to(ROOT).parts
        for i, line in enumerate(_text(p).splitlines(), 1):
            code = line.split("#", 1)[0]
            bad = private.search(code) or (not keyed and private_op.search(code))
            if bad and "TYPE_CHECKING" not in code and '"""' not in code:
                found.append(f"{p.relative_to(ROOT.parent)}:{i}: {line.strip()}")
    # type annotations only (never evaluated: `from __future__ import annotations`)
    allowed = {"def lookup(func: torch._ops.OpOverload) -> Rule | None:"}
    assert [f for f in found if f.split(": ", 1)[1] not in allowed] == []


@pytest.mark.parametrize("name", sorted(torch_private.ENTRIES))
def test_every_private_entry_resolves_on_this_torch(name: str) -> None:
    obj = torch_private.get(name)
    assert obj is not None
    location = torch_private.ENTRIES[name][0]
    assert location.startswith("torch.")


def test_a_missing_private_api_is_named_with_the_fix(monkeypatch) -> None:
    monkeypatch.setitem(torch_private.ENTRIES, "gone", ("torch._no_such_api", "a test"))
    with pytest.raises(
        torch_private.TorchChanged, match=r"torch\._no_such_api \(a test\).*torch>=2\.6"
    ):
        torch_private.get("gone")
    monkeypatch.setattr(torch, "_foreach_lerp", None, raising=False)
    monkeypatch.delattr(torch, "_foreach_lerp")
    monkeypatch.delitem(torch_private._CACHE, "foreach_lerp", raising=False)
    assert "foreach_lerp" in torch_private.check_all()
    with pytest.raises(torch_private.TorchChanged, match="Adam's first moment"):
        torch_private.foreach_lerp([torch.zeros(1)], [torch.ones(1)], 0.5)


def test_zero3_without_blocks_names_the_key_and_the_fix() -> None:
    cfg = models.gpt.Config(vocab_size=16, n_layer=2, n_head=2, d_model=8, max_seq_len=8)
    params = models.gpt.init(cfg)
    flat = {"layers": params["blocks"], "rest": params["final_norm"]}
    step = cf.train_step(lambda p, b: sum(x.sum() for x in cf.tree.tensors(p)), optim.sgd(0.1))

    def main(mesh):
        cf.zero(cf.shard(step, mesh), stage=3).init(flat)

    with pytest.raises(
        cf.sharding.RankFailedError, match=r"no 'blocks' entry.*\['layers', 'rest'\]"
    ):
        cf.launch(main, mesh={"dp": 2})


def test_cli_main_has_its_docstring() -> None:
    from colfunc import cli

    assert cli.main.__doc__ is not None and "exit status" in cli.main.__doc__


def test_no_folder_on_the_import_path_shadows_pypi_kernels() -> None:
    """transformers imports PyPI's ``kernels`` package; a ``kernels.py`` or ``kernels/`` in a
    folder that tests and benchmarks put on ``sys.path`` would be imported in its place (the
    kernel sources live in ``colfunc/kernels``, the GPU kernel benchmark in
    ``benchmarks/triton_kernels.py``)."""
    repo = ROOT.parent
    folders = [repo, *(repo / d for d in ("benchmarks", "tests", "examples"))]
    shadows = [
        str(f / name) for f in folders for name in ("kernels.py", "kernels") if (f / name).exists()
    ]
    assert shadows == []


def test_no_source_file_is_over_600_lines() -> None:
    """Files with one job each: 500 lines is the signal to split, 600 the limit."""
    long = {str(p.relative_to(ROOT)): n for p in SOURCES if (n := len(_text(p).splitlines())) > 600}
    assert long == {}, f"split these by job: {long}"
