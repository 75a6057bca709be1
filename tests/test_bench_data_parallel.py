"""``benchmarks/data_parallel.py`` compares equal computations: on gloo processes each colfunc
scheme gives its PyTorch peer's losses, and for data parallel the same bytes per step (our ledger
against the collectives torch issues, counted with the same ring formulas)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import data_parallel

pytestmark = pytest.mark.timeout(120)


def test_schemes_match_their_torch_peers_on_gloo() -> None:
    cfg = data_parallel.gpt.Config(vocab_size=64, n_layer=2, n_head=4, d_model=32, max_seq_len=16)
    schemes = list(data_parallel.SCHEMES)
    rows = data_parallel.run(2, schemes, cfg, batch_size=4, steps=1, warmup=1)
    assert [r["scheme"] for r in rows] == schemes
    for r in rows:
        assert r["loss_gap"] < 1e-5, r
        assert r["ours_bytes"] > 0 and r["theirs_bytes"] > 0, r
        assert r["ratio"] > 0 and r["cpu_ratio"] > 0, r
    by = {r["scheme"]: r for r in rows}
    # DDP all-reduces the whole gradient, FSDP2 gathers parameters and scatters gradients: the
    # traffic of stages 0 and 3, which also all-reduce the scalar loss (and stage 3 the squared
    # gradient norm); the counter run over our step reproduces our ledger
    for scheme in ("zero0", "zero3"):
        r = by[scheme]
        assert r["ours_counted"] == r["ours_bytes"], r
        assert 0 < r["ours_bytes"] - r["theirs_bytes"] <= 2 * 4, r
    # Megatron's 2 all-reduces per block forward and 4 (q, k, v, fc inputs) backward, per rank:
    # the activation [B, T, D] fp32 each, (n - 1) / n * 2 of it sent with n = 2
    activation = 4 * cfg.max_seq_len * cfg.d_model * 4
    assert by["tp2"]["theirs_bytes"] == cfg.n_layer * 6 * activation


def test_the_control_pairs_equal_sides() -> None:
    """``--control`` times two instances of the same colfunc step, and of the same DDP peer:
    their losses agree exactly at every step (the pairs compare equal computations), whether
    the instances are built where the allocation sequence puts them or at drawn offsets (after
    a process warm-up whose figures are dropped), and the control row comes first."""
    cfg = data_parallel.gpt.Config(vocab_size=64, n_layer=2, n_head=4, d_model=32, max_seq_len=16)
    for placement, first in ((None, 0), (3, 2)):  # fixed, and at drawn offsets after a warm-up
        rows = data_parallel.run(
            2,
            ["dp"],
            cfg,
            batch_size=4,
            steps=2,
            warmup=1,
            with_control=True,
            placement=placement,
            process_warmup=first,
        )
        assert [r["scheme"] for r in rows] == ["control", "dp"]
        assert rows[0]["loss_gap"] == 0.0
        assert rows[0]["ours"] > 0 and rows[0]["torch"] > 0


def test_the_in_out_peer_computes_what_ours_computes() -> None:
    """``--peer-weights in_out``: DDP over Linear layers whose weights are stored [in, out], as
    ours are, runs the same matmuls: its losses equal ours at every step, and it starts from the
    same weights (its layers hold ours, not their transposes)."""
    cfg = data_parallel.gpt.Config(vocab_size=64, n_layer=2, n_head=4, d_model=32, max_seq_len=16)
    rows = data_parallel.run(
        2, ["dp", "zero0"], cfg, batch_size=4, steps=2, warmup=1, peer_weights="in_out"
    )
    assert [r["loss_gap"] for r in rows] == [0.0, 0.0], rows
    linear = data_parallel.GPT(cfg).blocks[0].fc
    fc = data_parallel.InOutLinear(linear)
    assert fc.weight.shape == (cfg.d_model, 4 * cfg.d_model)  # [in, out]
    x = data_parallel.torch.randn(3, cfg.d_model)
    data_parallel.torch.testing.assert_close(fc(x), linear(x), rtol=1e-6, atol=1e-6)


def test_runs_combine_as_medians_over_runs() -> None:
    """``--runs``: each figure of a combined row is the median over runs of that run's figure,
    the loss gap the largest, and every run's ratio is kept in order; runs whose schemes differ,
    or no runs, are refused."""

    def row(scheme: str, ratio: float, gap: float = 0.0) -> dict:
        return {
            "scheme": scheme,
            "ours_s": ratio,
            "theirs_s": 1.0,
            "ratio": ratio,
            "cpu_ratio": 2 * ratio,
            "loss_gap": gap,
            "ours_bytes": 7,
        }

    runs = [
        [{"scheme": "control", "ours": 1.0, "torch": 0.9, "loss_gap": 0.0}, row("dp", 1.2, 1e-7)],
        [{"scheme": "control", "ours": 1.1, "torch": 1.0, "loss_gap": 0.0}, row("dp", 0.9)],
        [{"scheme": "control", "ours": 0.8, "torch": 1.2, "loss_gap": 0.0}, row("dp", 1.0, 3e-7)],
    ]
    control, dp = data_parallel.combine(runs)
    assert (control["ours"], control["torch"], control["ratios"]) == (1.0, 1.0, [1.0, 1.1, 0.8])
    assert (dp["ratio"], dp["cpu_ratio"], dp["ours_s"]) == (1.0, 2.0, 1.0)
    assert dp["ratios"] == [1.2, 0.9, 1.0]
    assert dp["loss_gap"] == 3e-7 and dp["ours_bytes"] == 7
    with pytest.raises(ValueError, match="different schemes"):
        data_parallel.combine([[row("dp", 1.0)], [row("zero0", 1.0)]])
    with pytest.raises(ValueError, match="no runs"):
        data_parallel.combine([])


def test_median_interval_is_the_order_statistic_interval_and_covers_as_it_says() -> None:
    """The interval printed beside each scheme's runs: the order statistics that enclose the
    median with binomial coverage (9 runs: the 2nd and 8th, 1 - 2 * 10/512); too few runs give
    none; and drawn samples contain their distribution's median as often as it says."""
    xs = [1.011, 0.988, 0.998, 0.996, 1.006, 1.004, 0.997, 1.009, 0.995]
    lo, hi, coverage = data_parallel.median_interval(xs)
    assert (lo, hi) == (0.995, 1.009) and coverage == pytest.approx(1 - 20 / 512)
    assert data_parallel.median_interval(xs[:4]) is None  # the extremes of 4 cover 0.875
    assert data_parallel.median_interval(xs[:5])[:2] == (0.988, 1.011)  # 5 runs: 1 - 2/32
    gen = data_parallel.torch.Generator().manual_seed(0)
    trials, inside = 2000, 0
    for _ in range(trials):  # runs drawn from a skewed distribution whose median is ln 2
        draws = data_parallel.torch.empty(9).exponential_(generator=gen).tolist()
        lo, hi, coverage = data_parallel.median_interval(draws)
        inside += lo <= 0.6931471805599453 <= hi
    assert abs(inside / trials - coverage) < 0.02  # binomial sd of the rate: 0.004
    assert "96% interval 0.995-1.009" in data_parallel._listed(xs)


def test_each_run_draws_where_each_side_builds_its_state() -> None:
    """``--placement drawn``: the block held while a side builds its state has a size drawn from
    (run, rank, scheme, side), the same every time for the same key, different across runs and
    sides, in 64-byte steps; ``fixed`` (seed None) holds nothing."""
    sizes = {
        (run, side): data_parallel.shift_heap(run, 0, "dp", side)[0].numel()
        for run in range(6)
        for side in ("ours", "torch")
    }
    assert all(n % 64 == 0 and 64 <= n < 2**22 for n in sizes.values())
    assert len(set(sizes.values())) == len(sizes)
    assert data_parallel.shift_heap(3, 0, "dp", "ours")[0].numel() == sizes[3, "ours"]
    assert data_parallel.shift_heap(None, 0, "dp", "ours") == []
