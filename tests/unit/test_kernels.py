"""The simulation kernels in one process: accuracy, invariants, decomposition arithmetic, configs, sinks.

MPI runs here on a communicator of one rank (``MPI.COMM_SELF``); the 1/2/4-rank agreement is
tested under mpiexec in tests/workflows/test_kernels_mpi.py.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcml.errors import ConfigError
from kernels import gray_scott, heat2d
from kernels.common import (H5Sink, MemorySink, block, build_parser, config_from_args, decompose, grid_dims,
                            split_extent)

ROOT = Path(__file__).resolve().parents[2]
SELF = MPI.COMM_SELF


def _heat_error(n: int, t_end: float = 0.05) -> tuple[float, float]:
    """(dx, max error) of the sine case at ``t_end``, with dt = t_end / steps ~ 0.2 dx^2."""
    h = 1.0 / (n + 1)
    steps = math.ceil(t_end / (0.2 * h * h))
    cfg = heat2d.HeatConfig(nx=n, ny=n, steps=steps, every=steps, dt=t_end / steps, init="sine")
    decomp = decompose(SELF, n, n, periodic=False)
    field = heat2d.run(SELF, cfg, decomp=decomp)
    return h, float(np.abs(field - heat2d.exact(cfg, t_end, decomp)).max())


def test_heat_converges_at_second_order_to_the_analytic_solution():
    (h1, e1), (h2, e2), (h3, e3) = (_heat_error(n) for n in (16, 32, 64))
    orders = [math.log(e1 / e2) / math.log(h1 / h2), math.log(e2 / e3) / math.log(h2 / h3)]
    assert all(1.8 <= p <= 2.2 for p in orders), orders
    assert e3 < 2e-4  # and the error itself is small: exp(-2 pi^2 0.05) = 0.37 is the peak value


def test_heat_source_adds_its_heat_and_peaks_at_its_centre():
    """From a cold start with cold walls, the first step adds exactly dt x q (the Laplacian of
    zero is zero); later the field peaks on the grid point nearest the centre and the heat
    stays below what the source put in (the walls take some)."""
    one = heat2d.HeatConfig(nx=21, ny=21, steps=1, every=1, t_init=0.0, source_power=3.0, source_x=0.3,
                            source_y=0.7, source_width=0.05)
    d = decompose(SELF, 21, 21, periodic=False)
    q = heat2d.source(one, d)
    np.testing.assert_allclose(heat2d.run(SELF, one, decomp=d), one.time_step * q, rtol=1e-12)
    i, j = np.unravel_index(np.argmax(q), q.shape)
    r2 = (7 / 22 - 0.3) ** 2 + (15 / 22 - 0.7) ** 2  # the grid point (6, 14) is the nearest to (0.3, 0.7)
    assert (i, j) == (6, 14) and q.max() == pytest.approx(3.0 / (2 * np.pi * 0.05**2) * np.exp(-r2 / (2 * 0.05**2)),
                                                          rel=1e-12)
    many = dataclasses.replace(one, steps=200, every=200)
    field = heat2d.run(SELF, many)
    assert np.unravel_index(np.argmax(field), field.shape) == (i, j)
    assert 0 < field.sum() < 200 * one.time_step * q.sum()
    assert q.sum() * one.spacing[0] ** 2 == pytest.approx(3.0, rel=1e-3)  # its integral is source_power
    assert heat2d.source(heat2d.HeatConfig(), d) is None  # no source: the plain heat equation


def test_heat_walls_and_steady_state():
    # Hot left wall, others cold: after long enough the field is the harmonic steady state,
    # which on the line of symmetry y = 1/2 falls monotonically from the hot wall.
    cfg = heat2d.HeatConfig(nx=12, ny=11, steps=1500, every=1500, t_left=1.0, t_init=0.0)
    field = heat2d.run(SELF, cfg)
    mid = field[:, 5]
    assert np.all(np.diff(mid) < 0) and 0.0 < mid[-1] < mid[0] < 1.0
    np.testing.assert_allclose(field, field[:, ::-1], rtol=0, atol=1e-15)  # symmetric in y


def test_gray_scott_conserves_u_plus_v_without_feed_or_kill():
    # With F = k = 0 the reaction only moves mass from u to v and diffusion on a periodic grid
    # moves it around: sum(u + v) is conserved (sum(u) alone is not once v > 0).
    cfg = gray_scott.GrayScottConfig(nx=24, ny=20, steps=200, every=200, F=0.0, k=0.0, Du=0.2, Dv=0.1, seed=3)
    decomp = decompose(SELF, 24, 20, periodic=True)
    start = gray_scott.initial_state(cfg, decomp)[:, 1:-1, 1:-1]
    end = gray_scott.run(SELF, cfg, decomp=decomp)
    assert abs(end.sum(axis=0).mean() - start.sum(axis=0).mean()) < 1e-12
    assert abs(end[0].mean() - start[0].mean()) > 1e-3  # the reaction did move mass


def test_gray_scott_initial_state_is_the_same_sliced_from_any_decomposition():
    cfg = gray_scott.GrayScottConfig(nx=13, ny=9, seed=7)
    whole = gray_scott.initial_state(cfg, decompose(SELF, 13, 9, periodic=True))[:, 1:-1, 1:-1]
    # Pretend to be each of 6 ranks (3 x 2 blocks) and cut the same field from global indices.
    dims = grid_dims(13, 9, 6)
    for cx in range(dims[0]):
        for cy in range(dims[1]):
            offset, shape = block(13, 9, dims, (cx, cy))
            d = decompose(SELF, 13, 9, periodic=True)
            fake = type(d)(global_shape=(13, 9), offset=offset, local_shape=shape, dims=dims, coords=(cx, cy),
                           periodic=True, comm=d.comm)
            part = gray_scott.initial_state(cfg, fake)[:, 1:-1, 1:-1]
            (x0, y0), (lx, ly) = offset, shape
            np.testing.assert_array_equal(part, whole[:, x0:x0 + lx, y0:y0 + ly])
    other = gray_scott.initial_state(gray_scott.GrayScottConfig(nx=13, ny=9, seed=8), d)[:, 1:-1, 1:-1]
    assert not np.array_equal(other, whole)
    assert 0.495 <= whole[0].min() < 0.51 and 0.99 < whole[0].max() <= 1.005 and whole[1].max() <= 0.25 * 1.02


def test_split_extent_spreads_the_remainder_over_the_first_blocks():
    assert [split_extent(10, 4, i) for i in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert [split_extent(3, 3, i) for i in range(3)] == [(0, 1), (1, 1), (2, 1)]


def test_blocks_of_7x5_over_6_ranks_tile_the_grid_once():
    dims = grid_dims(7, 5, 6)
    assert dims == (3, 2)
    cover = np.zeros((7, 5), dtype=int)
    shapes = {}
    for cx in range(3):
        for cy in range(2):
            (x0, y0), (lx, ly) = block(7, 5, dims, (cx, cy))
            cover[x0:x0 + lx, y0:y0 + ly] += 1
            shapes[cx, cy] = (lx, ly)
    assert (cover == 1).all()
    assert shapes == {(0, 0): (3, 3), (0, 1): (3, 2), (1, 0): (2, 3), (1, 1): (2, 2), (2, 0): (2, 3), (2, 1): (2, 2)}


def test_grid_smaller_than_the_process_grid_is_rejected_with_the_numbers():
    with pytest.raises(ConfigError, match=r"^nx=2 is smaller than the 3 ranks along x \(process grid 3x2 for 6 ranks\)"
                                          r": expected nx >= 3$"):
        grid_dims(2, 5, 6)
    with pytest.raises(ConfigError, match=r"^ny=1 is smaller than the 2 ranks along y .*expected ny >= 2$"):
        grid_dims(7, 1, 6)


def test_decompose_on_one_rank_is_the_whole_grid():
    d = decompose(SELF, 9, 4, periodic=True)
    assert (d.global_shape, d.offset, d.local_shape, d.dims, d.coords, d.periodic) == ((9, 4), (0, 0), (9, 4), (1, 1),
                                                                                      (0, 0), True)
    assert d.comm.Get_topology() == MPI.CART and d.comm.Get_topo()[1] == [1, 1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(alpha=-1.0), "alpha must be > 0, got -1.0"),
    (dict(alpha=float("nan")), "alpha must be > 0, got nan"),
    (dict(nx=0), "nx must be an integer >= 1, got 0"),
    (dict(every=0), "every must be an integer >= 1, got 0"),
    (dict(nx=32, ny=32, dt=0.01), "dt=0.01 is unstable: expected dt <= 0.000229568 (explicit limit"),
    (dict(dt=-1e-5), "dt must be > 0, got -1e-05"),
    (dict(init="sine", t_top=2.0),
     "init='sine' is the analytic case with zero boundary temperatures and no source, got t_top=2.0"),
    (dict(init="sine", source_power=1.0),
     "init='sine' is the analytic case with zero boundary temperatures and no source, got source_power=1.0"),
    (dict(source_width=0.0), "source_width must be > 0, got 0.0"),
    (dict(source_power=-1.0), "source_power must be >= 0, got -1.0"),
    (dict(source_x=float("inf")), "source_x must be a finite number, got inf"),
    (dict(source_width=float("inf")), "source_width must be a finite number, got inf"),
    (dict(crash_at_step=0), "crash_at_step must be >= 1, got 0"),
])
def test_heat_config_rejects_bad_values_naming_them(kwargs, message):
    with pytest.raises(ConfigError) as e:
        heat2d.HeatConfig(**kwargs)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("kwargs, message", [
    (dict(Du=0.0), "Du must be > 0, got 0.0"),
    (dict(k=-0.01), "k must be >= 0, got -0.01"),
    (dict(seed=2.5), "seed must be an integer >= 0, got 2.5"),
    (dict(Du=0.5, dt=1.0), "dt=1 is unstable: expected dt <= 0.5 (explicit limit 1/(2 max(Du, Dv) (1/dx^2 + 1/dy^2))"),
])
def test_gray_scott_config_rejects_bad_values_naming_them(kwargs, message):
    with pytest.raises(ConfigError) as e:
        gray_scott.GrayScottConfig(**kwargs)
    assert str(e.value).startswith(message)


def test_default_dt_is_a_fixed_fraction_of_the_stability_limit():
    assert heat2d.HeatConfig(nx=9, ny=9, alpha=2.0).time_step == pytest.approx(0.2 * 0.1**2 / 2.0)
    assert gray_scott.GrayScottConfig().time_step == pytest.approx(1.0)  # 0.8 / (4 * 0.2)
    assert gray_scott.GrayScottConfig(seed=4.0).seed == 4  # a JSON number is fine when whole


def test_params_json_then_explicit_flags():
    parser = build_parser(gray_scott.SPEC)
    args = parser.parse_args(["--params-json", '{"F": 0.03, "k": 0.055, "seed": 5}', "--k", "0.05", "--nx", "20"])
    cfg = config_from_args(gray_scott.GrayScottConfig, args)
    assert (cfg.F, cfg.k, cfg.seed, cfg.nx, cfg.Du) == (0.03, 0.05, 5, 20, 0.2)
    assert cfg.params == {"F": 0.03, "k": 0.05, "Du": 0.2, "Dv": 0.1, "seed": 5.0}
    for text, message in [('{"F": 0.03, "kk": 1}',
                           "unknown parameter 'kk' in --params-json: expected one of F, k, Du, Dv, seed"),
                          ('{"F": "x"}', "parameter F in --params-json must be a number, got 'x'"),
                          ('[1]', "--params-json must be a JSON object, got list"),
                          ('{"F": }', "--params-json is not valid JSON (Expecting value at character 6)")]:
        with pytest.raises(ConfigError) as e:
            config_from_args(gray_scott.GrayScottConfig, parser.parse_args(["--params-json", text]))
        assert str(e.value).startswith(message)
    heat_args = build_parser(heat2d.SPEC).parse_args(["--init", "sine", "--alpha", "0.5"])
    heat = config_from_args(heat2d.HeatConfig, heat_args)
    assert (heat.init, heat.alpha, heat.t_init) == ("sine", 0.5, 1.0)


def test_memory_sink_receives_every_kth_step_as_float32_blocks():
    cfg = heat2d.HeatConfig(nx=10, ny=7, steps=25, every=10, t_bottom=1.0)
    sink = MemorySink()
    final = heat2d.run(SELF, cfg, sink)
    assert [(s, t) for s, t, _ in sink.records] == [(10, 10 * cfg.time_step), (20, 20 * cfg.time_step)]
    for _, _, fields in sink.records:
        assert list(fields) == ["T"]
        assert fields["T"].shape == (10, 7) and fields["T"].dtype == np.float32 and fields["T"].flags.c_contiguous
    assert not sink.closed  # the caller owns the sink
    gs = MemorySink()
    u, v = gray_scott.run(SELF, gray_scott.GrayScottConfig(nx=6, ny=5, steps=9, every=3), gs)
    assert [s for s, _, _ in gs.records] == [3, 6, 9] and list(gs.records[-1][2]) == ["u", "v"]
    np.testing.assert_array_equal(gs.records[-1][2]["v"], v.astype(np.float32))
    assert final[5, 0] > final[5, 3] > 0.0  # heat came in from the warm side y = 0
    at_20 = heat2d.run(SELF, heat2d.HeatConfig(nx=10, ny=7, steps=20, every=10, t_bottom=1.0))
    np.testing.assert_array_equal(sink.records[-1][2]["T"], at_20.astype(np.float32))


def test_h5_sink_keeps_an_incomplete_file_under_its_temporary_name(tmp_path):
    d = decompose(SELF, 4, 3, periodic=False)
    path = tmp_path / "sim.h5"
    sink = H5Sink(path, d, kernel="heat2d", params={"alpha": 1.0}, field_names=["T"], n_outputs=2, sim_id=7)
    sink.send(5, 0.5, {"T": np.ones((4, 3), np.float32)})
    sink.close()
    assert not path.exists() and (tmp_path / "sim.h5.tmp").exists()
    sink = H5Sink(path, d, kernel="heat2d", params={"alpha": 1.0}, field_names=["T"], n_outputs=1, sim_id=7)
    sink.send(5, 0.5, {"T": np.full((4, 3), 2.0, np.float32)})
    with pytest.raises(ValueError, match="more outputs than the 1 the file was made for"):
        sink.send(10, 1.0, {"T": np.ones((4, 3), np.float32)})
    sink.close()
    with h5py.File(path, "r") as f:
        assert f["fields/T"][0].tolist() == [[2.0] * 3] * 4 and f["step"][:].tolist() == [5]
        assert f.attrs["sim_id"] == 7 and f.attrs["kernel"] == "heat2d"


def test_kernels_do_not_import_torch():
    code = ("import sys, kernels.heat2d, kernels.gray_scott; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch', 'parsl', 'zmq', 'hpcml.stream'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
