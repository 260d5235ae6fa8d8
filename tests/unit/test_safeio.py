"""hpcml.safeio against a hostile, group-writable run directory: links out, dangling links,
FIFOs, directories, hard links, sparse and preallocated files, links on the way under
``root``, deep JSON. Each case asserts values, and fails if its protection were taken out;
every FIFO case runs under a 2 s watchdog that frees a stuck call."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import pytest

from hpcml import safeio
from hpcml.errors import ConfigError
from hpcml.safeio import MAX_DEPTH, FileRefused

SECRET = b'{"secret": "outside"}\n'  # JSON, text and a line: any reader following a link would return it
LIMIT = 1 << 20
READS = {
    "read_bytes": lambda p, **k: safeio.read_bytes(p, LIMIT, **k),
    "read_text": lambda p, **k: safeio.read_text(p, LIMIT, **k),
    "read_json": lambda p, **k: safeio.read_json(p, LIMIT, **k),
    "iter_lines": lambda p, **k: list(safeio.iter_lines(p, 4096, **k)),
}


@pytest.fixture
def outside(tmp_path):
    (tmp_path / "outside").mkdir()
    (secret := tmp_path / "outside" / "secret").write_bytes(SECRET)
    return secret


@pytest.fixture
def run(tmp_path):
    (tmp_path / "run").mkdir()
    return tmp_path / "run"


def _refused(fn, path, *words):
    """The one-line FileRefused message of ``fn()``, which names ``path`` and each of ``words``."""
    with pytest.raises(FileRefused) as ei:
        fn()
    msg = str(ei.value)
    assert isinstance(ei.value, ConfigError) and isinstance(ei.value, ValueError)
    assert "\n" not in msg and str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def _quick(fn, fifo, seconds=5.0):
    """fn()'s value, or the exception it raised, asserting it came within ``seconds``; a call stuck
    on the FIFO is freed (the FIFO opened both ways) before the test fails."""
    box = []

    def target():
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 -- handed to the test
            box.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        t.join(5)
        os.close(fd)
        pytest.fail(f"{fn} blocked on the FIFO {fifo} for more than {seconds} s")
    return box[0]


@pytest.mark.parametrize("reader", READS)
@pytest.mark.parametrize("target", ["outside", "dangling"])
@pytest.mark.parametrize("use_root", [False, True])
def test_reads_refuse_symlinks(reader, target, use_root, run, outside):
    link = run / "state.json"
    link.symlink_to(outside if target == "outside" else run / "nowhere")
    _refused(lambda: READS[reader](link, root=run if use_root else None), link, "symbolic link")
    assert not (run / "nowhere").exists() and outside.read_bytes() == SECRET


@pytest.mark.parametrize("reader", READS)
def test_reads_refuse_fifo_at_once_and_directory(reader, run):
    os.mkfifo(fifo := run / "fifo")
    got = _quick(lambda: READS[reader](fifo), fifo)
    assert isinstance(got, FileRefused) and "FIFO" in str(got) and str(fifo) in str(got), got
    (d := run / "dir").mkdir()
    _refused(lambda: READS[reader](d), d, "a directory")


def test_reads_of_missing_file_and_tail_never_fails(run, outside):
    missing = run / "missing"
    assert [safeio.read_bytes(missing, LIMIT), safeio.read_text(missing, LIMIT), safeio.read_json(missing, LIMIT)] \
        == [None, None, None]
    assert list(safeio.iter_lines(missing, 10)) == [] and safeio.tail(missing, 100) == b""
    (log := run / "log").write_bytes(b"0123456789")
    assert safeio.tail(log, 4) == b"6789" and safeio.tail(log, 100, root=run) == b"0123456789"
    (run / "link").symlink_to(outside)
    (run / "dangling").symlink_to(run / "nowhere")
    (run / "dir").mkdir()
    os.mkfifo(run / "fifo")
    for name in ("link", "dangling", "dir"):
        assert safeio.tail(run / name, 100) == b"", name
    assert _quick(lambda: safeio.tail(run / "fifo", 100), run / "fifo") == b""


def test_append_creates_missing_and_appends(run):
    safeio.append(run / "log", "one\n")
    safeio.append(run / "log", b"two\n", fsync=True)
    assert (run / "log").read_bytes() == b"one\ntwo\n"
    (run / "a" / "b").mkdir(parents=True)
    safeio.append(run / "a" / "b" / "log", "x\n", root=run)
    assert (run / "a" / "b" / "log").read_bytes() == b"x\n"


@pytest.mark.parametrize("use_root", [False, True])
def test_append_refuses_links(use_root, run, outside):
    root = run if use_root else None
    (link := run / "log").symlink_to(outside)
    _refused(lambda: safeio.append(link, "evil\n", root=root), link, "symbolic link")
    (dangling := run / "dangling").symlink_to(run / "created")
    _refused(lambda: safeio.append(dangling, "evil\n", root=root), dangling, "symbolic link")
    assert outside.read_bytes() == SECRET and not (run / "created").exists() and link.is_symlink()


def test_append_refuses_fifo_at_once_and_directory(run):
    os.mkfifo(fifo := run / "fifo")
    got = _quick(lambda: safeio.append(fifo, "x\n"), fifo)
    assert isinstance(got, FileRefused) and "FIFO" in str(got) and str(fifo) in str(got), got
    (d := run / "dir").mkdir()
    _refused(lambda: safeio.append(d, "x\n"), d, "a directory")
    assert list(d.iterdir()) == []


def test_hard_link_append_refused_replace_leaves_other_name(run, outside):
    os.link(outside, hard := run / "log")
    _refused(lambda: safeio.append(hard, "evil\n"), hard, "2 hard links")
    assert outside.read_bytes() == SECRET
    # replace renames a fresh file over the name: the other name keeps its content (not refused)
    safeio.replace(hard, "new\n", root=run)
    assert hard.read_bytes() == b"new\n" and outside.read_bytes() == SECRET and os.stat(outside).st_nlink == 1


def test_sparse_10gib_refused_fast_by_size(run):
    with open(big := run / "big.json", "wb"):
        pass
    os.truncate(big, 10 << 30)
    t0 = time.monotonic()
    for read in (READS["read_bytes"], READS["read_text"], READS["read_json"]):
        _refused(lambda: read(big), big, str(LIMIT), str(10 << 30), "refused before reading")
    assert time.monotonic() - t0 < 5.0


def test_blocks_allocated_past_size_refused(run):
    (pre := run / "pre.json").write_bytes(b"")
    if not shutil.which("fallocate") or subprocess.run(["fallocate", "-n", "-l", "8M", str(pre)]).returncode:
        pytest.skip("no fallocate --keep-size here")
    if pre.stat().st_size != 0 or pre.stat().st_blocks * 512 < 4 << 20:
        pytest.skip("this file system did not keep the blocks past the size")
    _refused(lambda: safeio.read_bytes(pre, LIMIT), pre, str(LIMIT))
    assert safeio.read_bytes(pre, 16 << 20) == b""  # under a limit that fits its blocks: read, empty


def test_root_refuses_symlinked_intermediate_directory(tmp_path, run, outside):
    (run / "sims").symlink_to(outside.parent)
    target = run / "sims" / "secret"
    before = sorted(p.name for p in outside.parent.iterdir())
    assert safeio.read_bytes(target, LIMIT) == SECRET  # without root the caller's path is trusted as given
    _refused(lambda: safeio.read_bytes(target, LIMIT, root=run), target, "'sims'")
    assert list(safeio.iter_lines(run / "ok", 10, root=run)) == []
    with pytest.raises(FileRefused):
        list(safeio.iter_lines(target, 4096, root=run))
    _refused(lambda: safeio.append(target, "evil\n", root=run), target, "'sims'")
    _refused(lambda: safeio.append(run / "sims" / "new", "evil\n", root=run), run / "sims" / "new")
    _refused(lambda: safeio.replace(target, "evil\n", root=run), target, "'sims'")
    _refused(lambda: safeio.replace(run / "sims" / "new", "evil\n", root=run), run / "sims" / "new")
    assert safeio.tail(target, 100, root=run) == b""
    assert outside.read_bytes() == SECRET and sorted(p.name for p in outside.parent.iterdir()) == before


def test_root_refuses_fifo_on_the_way(run):
    os.mkfifo(run / "sims")
    got = _quick(lambda: safeio.read_bytes(run / "sims" / "x", LIMIT, root=run), run / "sims")
    assert isinstance(got, FileRefused) and "'sims'" in str(got), got


def test_root_refuses_paths_out_of_it(tmp_path, run, outside):
    escaping = run / "sims" / ".." / ".." / "outside" / "secret"
    for path in (outside, escaping):
        _refused(lambda: safeio.read_bytes(path, LIMIT, root=run), path, "outside")
        _refused(lambda: safeio.append(path, "evil\n", root=run), path, "outside")
        _refused(lambda: safeio.replace(path, "evil\n", root=run), path, "outside")
    _refused(lambda: safeio.read_bytes(run, LIMIT, root=run), run, "not a file under")
    assert outside.read_bytes() == SECRET and sorted(os.listdir(outside.parent)) == ["secret"]


def test_root_nested_path_works(run):
    (run / "sims" / "7").mkdir(parents=True)
    rec = run / "sims" / "7" / "state.json"
    safeio.replace(rec, '{"step": 3}', root=run)
    assert safeio.read_json(rec, LIMIT, root=run) == {"step": 3}
    safeio.append(run / "sims" / "7" / "log", "a\nb\n", root=run)
    assert list(safeio.iter_lines(run / "sims" / "7" / "log", 10, root=run)) == [b"a\n", b"b\n"]
    assert safeio.read_text(rec, LIMIT, root=run) == '{"step": 3}' and safeio.tail(rec, 2, root=run) == b"3}"


def test_deep_nesting_refused_fast_without_recursion():
    for data in (b"[" * 100_000 + b"]" * 100_000, '{"a":' * 100_000, b'[{"k": "v", "l": [' * 50_000):
        t0 = time.monotonic()
        with pytest.raises(FileRefused, match="nested") as ei:
            safeio.parse_json(data, "deep.json")
        assert time.monotonic() - t0 < 5.0 and "deep.json" in str(ei.value) and "\n" not in str(ei.value)
    assert safeio.json_depth(b"[" * 100_000) == 100_000


def test_depth_boundary(run):
    ok = safeio.parse_json("[" * MAX_DEPTH + "]" * MAX_DEPTH, "w")
    for _ in range(MAX_DEPTH - 1):
        assert isinstance(ok, list) and len(ok) == 1
        ok = ok[0]
    assert ok == []
    _refused(lambda: safeio.parse_json("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "w"), "w",
             f"nested more than {MAX_DEPTH} deep")
    assert safeio.parse_json('{"a": {"b": [1]}}', "w", max_depth=3) == {"a": {"b": [1]}}
    _refused(lambda: safeio.parse_json('{"a": {"b": [[1]]}}', "w", max_depth=3), "w", "nested more than 3 deep")
    (f := run / "deep.json").write_text('{"a":' * MAX_DEPTH + "1" + "}" * MAX_DEPTH)
    assert safeio.read_json(f, LIMIT) is not None
    f.write_text('{"a":' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1))
    _refused(lambda: safeio.read_json(f, LIMIT), f, "nested")


def test_brackets_in_strings_do_not_count():
    assert safeio.json_depth(b'["[[[[[[[[", "{{{{{{"]') == 1
    assert safeio.json_depth(rb'["\"[[[[[[", "]]]"]') == 1
    assert safeio.json_depth(rb'["\\", [[1]]]') == 3  # an escaped backslash does not swallow the closing quote
    data = '{"a": "\\"' + "[" * 200 + '", "b": "' + "{" * 200 + '"}'
    assert safeio.parse_json(data, "w", max_depth=1) == {"a": '"' + "[" * 200, "b": "{" * 200}


@pytest.mark.parametrize("data", ["NaN", "[Infinity]", '{"a": -Infinity}', b'{"x": NaN}'])
def test_nan_and_infinity_refused(data):
    _refused(lambda: safeio.parse_json(data, "rec.json"), "rec.json", "not JSON")


def test_invalid_utf8_and_non_objects_refused(run):
    _refused(lambda: safeio.parse_json(b'{"a": "\xff\xfe"}', "rec.json"), "rec.json", "not JSON")
    (f := run / "rec.json").write_bytes(b'{"a": "\xc3\x28"}')
    _refused(lambda: safeio.read_json(f, LIMIT), f)
    f.write_bytes(b"[1, 2]")
    _refused(lambda: safeio.read_json(f, LIMIT), f, "expected a JSON object")
    assert safeio.read_text(f, LIMIT) == "[1, 2]"
    assert issubclass(FileRefused, ConfigError) and issubclass(FileRefused, ValueError)


def test_iter_lines_skips_long_line_and_keeps_torn_last(run):
    (f := run / "log").write_bytes(b"first\n" + b"x" * 100_000 + b"\n" + b"after\n" + b"torn")
    assert list(safeio.iter_lines(f, 100)) == [b"first\n", b"after\n", b"torn"]
    f.write_bytes(b"1234567\n" + b"123456789\n" + b"ok\n" + b"y" * 500)  # torn *and* too long: skipped
    assert list(safeio.iter_lines(f, 8)) == [b"1234567\n", b"ok\n"]


def test_replace_atomic_with_mode(run):
    rec = run / "state.json"
    safeio.replace(rec, "one", mode=0o600, root=run)
    assert rec.read_text() == "one" and rec.stat().st_mode & 0o777 == 0o600 and os.listdir(run) == ["state.json"]
    old = os.umask(0o077)
    try:
        safeio.replace(rec, b"two", mode=0o644, root=run, fsync=True)
    finally:
        os.umask(old)
    assert rec.read_bytes() == b"two" and rec.stat().st_mode & 0o777 == 0o644 and os.listdir(run) == ["state.json"]
    old = os.umask(0o077)
    try:
        safeio.replace(rec, "three", root=run)  # no mode given: the umask's, as open() would
    finally:
        os.umask(old)
    assert rec.read_text() == "three" and rec.stat().st_mode & 0o777 == 0o600


def test_replace_puts_a_file_where_a_link_was(run, outside):
    (link := run / "state.json").symlink_to(outside)
    (planted := run / f".state.json.{os.getpid()}.tmp").symlink_to(outside)  # a temporary name planted too
    safeio.replace(link, "mine\n", root=run)
    assert not link.is_symlink() and link.read_text() == "mine\n" and outside.read_bytes() == SECRET
    assert not os.path.lexists(planted) and sorted(os.listdir(run)) == ["state.json"]


def test_replace_refuses_fifo_and_directory(run):
    os.mkfifo(fifo := run / "fifo")
    got = _quick(lambda: safeio.replace(fifo, "x", root=run), fifo)
    assert isinstance(got, FileRefused) and "FIFO" in str(got) and str(fifo) in str(got), got
    (d := run / "dir").mkdir()
    _refused(lambda: safeio.replace(d, "x", root=run), d, "a directory")
    assert d.is_dir() and list(d.iterdir()) == [] and sorted(os.listdir(run)) == ["dir", "fifo"]


def test_replace_without_root(run, outside):
    (link := run / "state.json").symlink_to(outside)
    safeio.replace(link, "v")  # the parents as given, the temporary file beside the target
    assert link.read_text() == "v" and not link.is_symlink() and os.listdir(run) == ["state.json"]
    assert outside.read_bytes() == SECRET


def test_json_depth_linear_on_unterminated_escapes():
    t0 = time.monotonic()
    with pytest.raises(FileRefused):
        safeio.parse_json(b'[' * (MAX_DEPTH + 1) + b'"' + b'\\"' * 300_000, "w")
    assert safeio.json_depth(b'[["' + b'\\"' * 300_000) == 2  # one pass: an unterminated string is not rescanned
    assert time.monotonic() - t0 < 5.0


def test_depth_check_not_bypassed_by_utf16():
    doc = '["\u2200", ' + "[" * (MAX_DEPTH + 36) + "]" * (MAX_DEPTH + 36) + ', "x"]'
    with pytest.raises(FileRefused):
        safeio.parse_json(doc.encode("utf-16-le"), "w")


def test_lone_surrogate_str_refused():
    _refused(lambda: safeio.parse_json('{"a": "\ud800"}', "w"), "w")


def test_data_bytes_counts_what_a_file_holds_not_its_length(run):
    dense = run / "dense"
    dense.write_bytes(b"x" * (3 << 20))
    assert safeio.data_bytes(dense, dense.stat().st_size) == 3 << 20
    sparse = run / "sparse"
    sparse.write_bytes(b"y" * 4096)
    os.truncate(sparse, 1 << 30)  # a GiB long, 4 KiB held
    assert safeio.data_bytes(sparse, 1 << 30) < 1 << 20
    os.mkfifo(run / "fifo")
    assert safeio.data_bytes(run / "fifo", 0) == 0  # not a regular file: holds nothing hpcml counts


def test_every_reader_speaks_the_callers_error_class(run, outside):
    """One reader, each caller's exception (issue 44): ``error=`` names the class every refusal
    is raised as, ``error=None`` makes every refusal a miss, ``required`` makes a missing file
    a refusal; the messages are the file layer's whatever the class."""
    class Mine(ValueError):
        pass

    big, nested, link = run / "big.json", run / "nested.json", run / "link.json"
    big.write_bytes(b" " * (LIMIT + 1))
    nested.write_bytes(b"[" * (MAX_DEPTH + 1))
    link.symlink_to(outside)
    (run / "list.json").write_text("[1]")
    for path, words in ((big, "larger than"), (nested, "nested more than"), (link, "symbolic link"),
                        (run / "list.json", "expected a JSON object")):
        with pytest.raises(Mine) as ei:
            safeio.read_json(path, LIMIT, error=Mine)
        assert str(path) in str(ei.value) and words in str(ei.value) and not isinstance(ei.value, FileRefused)
        assert safeio.read_json(path, LIMIT, error=None) is None
    assert safeio.read_bytes(run / "gone", LIMIT, error=Mine) is None
    with pytest.raises(Mine, match=r"gone: no such file, expected a step name"):
        safeio.read_bytes(run / "gone", LIMIT, "a step name", error=Mine, required=True)
    assert safeio.read_text(run / "gone", LIMIT, error=None, required=True) is None
    (run / "ok.json").write_text('{"a": Infinity}')
    assert safeio.read_json(run / "ok.json", LIMIT, constants=True) == {"a": float("inf")}
    with pytest.raises(FileRefused, match="Infinity is not a number JSON allows"):
        safeio.read_json(run / "ok.json", LIMIT)


def test_read_fd_bounds_an_open_descriptor_and_leaves_it_open(run):
    path = run / "f"
    path.write_bytes(b"x" * 100)
    fd = safeio.open_fd(path)
    try:
        assert safeio.read_fd(fd, path, 100) == b"x" * 100
        with pytest.raises(KeyError, match=r"f: 100 bytes, larger than 99 bytes, expected a key"):
            safeio.read_fd(fd, path, 99, "a key", error=KeyError)
        os.fstat(fd)  # still open
    finally:
        os.close(fd)
    sparse = run / "sparse"
    sparse.write_bytes(b"y")
    os.truncate(sparse, 1 << 30)  # its length alone refuses it, before a byte is read
    fd = safeio.open_fd(sparse)
    try:
        t0 = time.monotonic()
        with pytest.raises(FileRefused, match="1073741824 bytes, larger than"):
            safeio.read_fd(fd, sparse, LIMIT)
        assert time.monotonic() - t0 < 1
    finally:
        os.close(fd)


def test_a_trainers_summary_with_a_diverged_loss_is_read_by_the_campaign_not_ignored(tmp_path):
    """A population whose members diverged wrote ``"final_loss": Infinity`` to train_summary.json:
    the campaign's strict reader refused the whole record ('ignoring the training job's
    summary'). Non-finite figures are written as null; everything else is kept as it was."""
    from types import SimpleNamespace

    from hpcml.train.online import OnlineResult, OnlineRun

    path = tmp_path / "train_summary.json"
    run = SimpleNamespace(config=SimpleNamespace(summary_file=str(path), campaign="c", run="r"))
    result = OnlineResult(status="ok", steps=20, summary={"final_loss": float("inf"), "samples_ingested": 16,
                                                          "val_rel_l2_members": [float("nan"), 0.25]})
    OnlineRun.write_summary(run, result, val_rel_l2=float("-inf"))
    rec = safeio.read_json(path, LIMIT)
    assert rec["final_loss"] is None and rec["val_rel_l2"] is None and rec["val_rel_l2_members"] == [None, 0.25]
    assert rec["samples_ingested"] == 16 and rec["status"] == "ok" and rec["campaign"] == "c"
    assert safeio.finite({"a": (1.5, float("nan")), "b": {"c": -float("inf")}, "d": "nan", "e": 3}) == \
        {"a": [1.5, None], "b": {"c": None}, "d": "nan", "e": 3}
