"""A job's outputs (`run --output` Parquet, the OpenAI Batch .jsonl, `run --ray` parts) are never
written through a name another local user controls: a symbolic link (to a file of ours, or dangling)
or another user's file planted at the output path in a shared directory is refused with the path and
why, before the job and again just before the file appears, and the file it points to is untouched.
An existing file of our own is replaced only with --overwrite. The directory must be ours or root's
and, if its group or others may write to it, sticky; it is reached one component at a time by
descriptors, so a link swapped in on the way (as it is made, as it is opened) is refused, not
followed; a rename that fails at the last moment keeps the results. A bad field in an input row
names the row, with --ray before any stack starts. The other user is a forked child that becomes
`nobody` (needs root; those tests skip otherwise); the last moments are reached by wrapping the os
call that comes next."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from moe_lightning.config.job import NodeJob, RowDefaults
from moe_lightning.output_files import OutputFileError, check_output_dir, check_output_file, output_file

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another uid's files needs root")
VICTIM = b"root's secret, mode 0600"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory like /tmp: anyone may add names (1777). Under /tmp, not tmp_path (0700: nobody
    could not reach it)."""
    d = Path(tempfile.mkdtemp(prefix="mlt-shared-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of ours (root's when run as root) that only we can read."""
    v = tmp_path / "victim"
    v.write_bytes(VICTIM)
    v.chmod(0o600)
    return v


def as_nobody(action: Callable[[], None]) -> None:
    """Runs `action` in a forked child that is another user (nobody)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the planting child failed"


def _table() -> pa.Table:
    return pa.table({"prompt": ["a", "b"], "text": ["x", "y"]})


def _write_parquet(path: Path, overwrite: bool = False) -> None:
    from moe_lightning.commands.run_job import write_table

    write_table(_table(), path, overwrite)


def _untouched(victim: Path) -> None:
    assert victim.read_bytes() == VICTIM and _mode(victim) == 0o600 and victim.stat().st_uid == os.geteuid()


def _kept(refusal: BaseException) -> Path:
    """The file a refused write kept its finished results in, as the message names it."""
    kept = Path(str(refusal).rsplit("the results are kept in ", 1)[1])
    assert kept.is_file() and kept.name.startswith(".") and kept.stat().st_uid == os.geteuid()
    return kept


def _write_openai(path: Path, overwrite: bool = False) -> None:
    from gateway.errors import bad_request
    from moe_lightning.commands.openai_batch import BatchLine, write_results

    write_results([BatchLine("c1", error=bad_request("no"))], "m", path, overwrite)


def _write_part(path: Path, overwrite: bool = False) -> None:
    from moe_lightning.cluster.parts import Part, write_part

    part = Part(0, 2)
    assert path.name == part.name
    write_part(pafs.LocalFileSystem(), str(path.parent), part, _table())


WRITERS = {
    "parquet": ("out.parquet", _write_parquet),
    "openai": ("results.jsonl", _write_openai),
    "ray-part": ("part-000000000000.parquet", _write_part),
}


# --- what another user plants in a shared directory ------------------------------------------------


@as_root
@pytest.mark.parametrize("kind", WRITERS)
def test_a_planted_link_to_our_file_is_refused_and_the_file_untouched(kind: str, shared: Path, victim: Path) -> None:
    name, write = WRITERS[kind]
    out = shared / name
    as_nobody(lambda: os.symlink(victim, out))
    with pytest.raises(OutputFileError, match=f"refusing to write the output {out}: it is a symbolic link"):
        check_output_file(out, overwrite=True)
    with pytest.raises(OutputFileError, match="it is a symbolic link") as refused:
        write(out, overwrite=True)  # not even with --overwrite
    _untouched(victim)
    kept = _kept(refused.value)  # the finished results stay beside it, under the name the message gives
    assert out.is_symlink() and sorted(os.listdir(shared)) == sorted([name, kept.name])


@as_root
@pytest.mark.parametrize("kind", WRITERS)
def test_a_planted_dangling_link_creates_nothing(kind: str, shared: Path, tmp_path: Path) -> None:
    name, write = WRITERS[kind]
    out, chosen = shared / name, shared / "theirs-to-read"  # where they want a file of ours
    as_nobody(lambda: os.symlink(chosen, out))
    with pytest.raises(OutputFileError, match="it is a symbolic link"):
        check_output_file(out)
    with pytest.raises(OutputFileError, match="it is a symbolic link") as refused:
        write(out)
    assert not chosen.exists() and sorted(os.listdir(shared)) == sorted([name, _kept(refused.value).name])


@as_root
@pytest.mark.parametrize("kind", WRITERS)
def test_another_users_file_is_refused_even_with_overwrite(kind: str, shared: Path) -> None:
    name, write = WRITERS[kind]
    out = shared / name

    def plant() -> None:
        out.write_bytes(b"theirs")
        out.chmod(0o666)

    as_nobody(plant)
    with pytest.raises(OutputFileError, match=f"owned by uid {NOBODY}, not by this user"):
        check_output_file(out, overwrite=True)
    with pytest.raises(OutputFileError, match=f"owned by uid {NOBODY}"):
        write(out, overwrite=True)
    assert out.read_bytes() == b"theirs" and out.stat().st_uid == NOBODY


@as_root
def test_a_link_planted_while_the_job_ran_is_refused_and_the_results_kept(shared: Path, victim: Path) -> None:
    """The early check passed; the link appears during the job (here: while the file is written):
    the last look before the rename refuses it, and names where the finished results are."""
    out = shared / "out.parquet"
    check_output_file(out)
    refusal = pytest.raises(OutputFileError, match="it is a symbolic link.*the results are kept in")
    with refusal as refused, output_file(out) as f:
        pq.write_table(_table(), f)
        as_nobody(lambda: os.symlink(victim, out))
    _untouched(victim)
    kept = Path(str(refused.value).rsplit("the results are kept in ", 1)[1])
    assert kept.parent == shared and kept.name.startswith(".out.parquet.")
    assert pq.read_table(kept).equals(_table()) and kept.stat().st_uid == os.geteuid()


@as_root
def test_a_link_of_another_user_on_the_way_is_refused(shared: Path, tmp_path: Path) -> None:
    """/tmp/shared/results -> a directory of ours: their link would choose where our file goes."""
    ours = tmp_path / "ours"
    ours.mkdir()
    as_nobody(lambda: os.symlink(ours, shared / "results"))
    for check in (check_output_file, _write_parquet):
        with pytest.raises(OutputFileError, match=f"{shared / 'results'} on its path is a symbolic link owned by"):
            check(shared / "results" / "out.parquet")
    with pytest.raises(OutputFileError, match="on its path is a symbolic link"):
        check_output_dir(shared / "results")
    assert os.listdir(ours) == []


@as_root
def test_a_ray_output_directory_must_be_ours_and_closed_to_others(shared: Path) -> None:
    from moe_lightning.cluster.parts import done_parts, output_dir

    theirs = shared / "theirs"
    as_nobody(lambda: theirs.mkdir(mode=0o755))
    with pytest.raises(OutputFileError, match=f"owned by uid {NOBODY}"):
        output_dir(str(theirs))
    with pytest.raises(OutputFileError, match="its mode is 1777: others may add files to it"):
        output_dir(str(shared))  # a part planted there would be taken as done
    mine = shared / "mine"
    fs, out = output_dir(str(mine))
    assert _mode(mine) & 0o002 == 0
    # a link under a part's name (pyarrow follows it) is not a done part
    (mine / "part-000000000000.parquet").symlink_to(shared / "x.parquet")
    _write_parquet(shared / "x.parquet")
    assert done_parts(fs, out) == set()


# --- the directory the output goes into ----------------------------------------------------------


@as_root
def test_a_directory_another_user_owns_is_refused(shared: Path) -> None:
    """Its owner may rename or delete anything in it (our temporary file, the finished output), and
    chmod it back open whatever mode it has now."""
    theirs = shared / "theirs"
    as_nobody(lambda: theirs.mkdir(mode=0o755))
    for check in (check_output_file, _write_parquet):
        with pytest.raises(OutputFileError, match=f"its directory is owned by uid {NOBODY}, not by this user or root"):
            check(theirs / "out.parquet")
    assert os.listdir(theirs) == []


def test_a_group_writable_directory_must_be_sticky(tmp_path: Path) -> None:
    """Its group may swap our files as anyone may in a 0777 one; sticky, they may only add names."""
    d = tmp_path / "group"
    d.mkdir()
    d.chmod(0o770)
    gid = d.stat().st_gid
    for check in (check_output_file, _write_parquet):
        with pytest.raises(OutputFileError, match=f"mode 0770: its group \\(gid {gid}\\) may replace files in it"):
            check(d / "out.parquet")
    assert os.listdir(d) == []
    d.chmod(0o1770)
    _write_parquet(d / "out.parquet")
    assert pq.read_table(d / "out.parquet").equals(_table())


def test_a_ray_output_directory_its_group_may_write_to_is_refused(tmp_path: Path) -> None:
    """A part its group planted would be taken as done: sticky or not (they may add names)."""
    from moe_lightning.cluster.parts import output_dir

    d = tmp_path / "parts"
    d.mkdir()
    for mode in (0o770, 0o1770):
        d.chmod(mode)
        with pytest.raises(OutputFileError, match=f"its mode is {mode:04o}: others may add files to it"):
            check_output_dir(d)
        with pytest.raises(OutputFileError, match="others may add files to it"):
            output_dir(str(d))


@pytest.mark.parametrize("umask", [0o000, 0o002])
def test_a_ray_output_directory_the_job_creates_is_never_refused(umask: int, tmp_path: Path) -> None:
    """pyarrow's create_dir made it 0777 (0775) less the umask, which the check then refused."""
    from moe_lightning.cluster.parts import output_dir

    out = tmp_path / "a" / "b"
    old = os.umask(umask)
    try:
        _, path = output_dir(str(out))
        output_dir(str(out))  # as each node does again before it writes a part
        _write_part(out / "part-000000000000.parquet")
    finally:
        os.umask(old)
    assert path == str(out) and _mode(out) == 0o755 and _mode(out.parent) == 0o755
    assert pq.read_table(out / "part-000000000000.parquet").equals(_table())


# --- the last moment: what someone puts at the name after the last look ---------------------------


def _plant_before_the_rename(out: Path, plant: Callable[[], None], monkeypatch: pytest.MonkeyPatch) -> None:
    """`plant` runs right before the rename into `out`: after the last look, which is all a race
    can win."""
    replace = os.replace

    def late(src: str, dst: str, **kw: int) -> None:
        if dst == out.name:
            plant()
        replace(src, dst, **kw)

    monkeypatch.setattr(os, "replace", late)


@pytest.mark.parametrize("who", ["ourselves", "nobody"])
def test_a_rename_that_fails_at_the_last_moment_keeps_the_results(
    who: str, shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory put at the name (by another user in a sticky directory, or by anything at all)
    makes the rename fail: the finished results stay under the temporary name, which the error (an
    OSError, which the CLI reports as one line) gives, instead of being deleted with the error a
    traceback."""
    if who == "nobody" and os.geteuid() != 0:
        pytest.skip("planting another uid's files needs root")
    d = shared if who == "nobody" else shared / "mine"
    d.mkdir(exist_ok=True)
    out = d / "out.parquet"
    _plant_before_the_rename(out, (lambda: as_nobody(out.mkdir)) if who == "nobody" else out.mkdir, monkeypatch)
    with pytest.raises(OutputFileError, match="renaming the finished file to it failed .*the results are kept in") as r:
        _write_parquet(out)
    assert isinstance(r.value, OSError) and out.is_dir()
    kept = Path(str(r.value).rsplit("the results are kept in ", 1)[1])
    assert kept.parent == d and kept.name.startswith(".out.parquet.")
    assert pq.read_table(kept).equals(_table()) and _mode(kept) == 0o644 & ~_umask()  # its final mode already


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_the_mode_is_set_before_the_last_look_not_between_it_and_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change of mode someone watches for (inotify) must not mark the moment between the last look
    at the name and the rename: the file gets its mode first, then the name is looked at."""
    events: list[str] = []
    fchmod, stat_, replace = os.fchmod, os.stat, os.replace

    def looked(name: object, *a: object, **kw: object) -> os.stat_result:
        if name == "out.parquet" and kw.get("dir_fd") is not None:
            events.append("look")
        return stat_(name, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fchmod", lambda fd, mode: (events.append("chmod"), fchmod(fd, mode))[1])
    monkeypatch.setattr(os, "stat", looked)
    monkeypatch.setattr(os, "replace", lambda *a, **kw: (events.append("rename"), replace(*a, **kw))[1])
    _write_parquet(tmp_path / "out.parquet")
    monkeypatch.undo()
    assert events[-1] == "rename" and "chmod" in events
    assert events[events.index("chmod") + 1 :] == ["look", "rename"], events
    assert pq.read_table(tmp_path / "out.parquet").equals(_table())


# --- the path to the directory: walked by descriptors, never by name -------------------------------


@as_root
def test_a_link_planted_as_the_directories_are_made_creates_nothing_where_it_points(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check found shared/results missing; before it is made, nobody puts a link there: the
    directories after it were made through the link (ours/sub), by name."""
    ours = tmp_path / "ours"
    ours.mkdir()
    mkdir, planted = os.mkdir, []

    def late(*a: object, **kw: object) -> None:
        if not planted:
            planted.append(1)
            as_nobody(lambda: os.symlink(ours, shared / "results"))
        mkdir(*a, **kw)  # type: ignore[arg-type]

    check_output_file(shared / "results" / "sub" / "out.parquet")
    monkeypatch.setattr(os, "mkdir", late)
    with pytest.raises(OutputFileError, match="results on its path is a symbolic link owned by uid"):
        _write_parquet(shared / "results" / "sub" / "out.parquet")
    monkeypatch.undo()
    assert planted and os.listdir(ours) == []


@as_root
def test_a_directory_swapped_for_a_link_while_it_is_opened_is_refused(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nobody owns a directory above ours (ours: root's, 0755, in theirs), so they may rename it: a
    link to a directory of ours swapped in as it is opened, swapped out as it is looked at again,
    put the file where the link pointed when the path was opened by name and checked by name."""
    nobodys = shared / "nobodys"
    as_nobody(lambda: nobodys.mkdir(mode=0o755))
    results, ours = nobodys / "results", tmp_path / "ours"
    results.mkdir()
    ours.mkdir()
    _write_parquet(results / "first.parquet")  # allowed: the directory itself is root's, closed to others
    swapped: list[bool] = []

    def swap_in() -> None:
        os.rename(results, nobodys / "real")
        os.symlink(ours, results)

    def swap_out() -> None:
        os.unlink(results)
        os.rename(nobodys / "real", results)

    real_open, real_lstat = os.open, os.lstat

    def opening(name: object, *a: object, **kw: object) -> int:
        if not swapped and os.path.basename(str(name)) == "results":
            swapped.append(True)
            as_nobody(swap_in)
        return real_open(name, *a, **kw)  # type: ignore[arg-type]

    def looking(name: object, *a: object, **kw: object) -> os.stat_result:
        if swapped == [True] and os.path.basename(str(name)) == "results":
            swapped.append(False)
            as_nobody(swap_out)
        return real_lstat(name, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", opening)
    monkeypatch.setattr(os, "lstat", looking)
    with pytest.raises(OutputFileError, match=f"{results} on its path is a symbolic link owned by uid {NOBODY}"):
        _write_parquet(results / "out.parquet")
    monkeypatch.undo()
    assert swapped and os.listdir(ours) == []


def test_a_link_of_ours_or_roots_on_the_way_is_followed_where_nobody_else_can_change_it(tmp_path: Path) -> None:
    """/var/run -> /run: a link of ours (or root's) in a directory closed to others is followed, as
    the kernel would (a relative target from the link's directory, `..` included); the same link in a
    directory anyone may rename in could be another link by the time it is read: refused."""
    (tmp_path / "real").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "rel").symlink_to("../real")
    (tmp_path / "abs").symlink_to(tmp_path / "a" / "rel")  # a link to a link
    for via in (tmp_path / "a" / "rel", tmp_path / "abs"):
        _write_parquet(via / "out.parquet", overwrite=True)
        assert pq.read_table(tmp_path / "real" / "out.parquet").equals(_table())
    check_output_dir(tmp_path / "abs" / "missing")
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(OutputFileError, match="too many levels of symbolic links"):
        check_output_file(tmp_path / "loop" / "out.parquet")
    (tmp_path / "a").chmod(0o777)
    with pytest.raises(OutputFileError, match="rel on its path is a symbolic link others may replace: its directory"):
        _write_parquet(tmp_path / "a" / "rel" / "new.parquet")
    assert not (tmp_path / "real" / "new.parquet").exists()


# --- our own files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["parquet", "openai"])
def test_our_own_file_needs_overwrite(kind: str, tmp_path: Path) -> None:
    name, write = WRITERS[kind]
    out = tmp_path / name
    out.write_bytes(b"yesterday's results")
    out.chmod(0o640)
    with pytest.raises(OutputFileError, match="it exists \\(pass --overwrite to replace it"):
        check_output_file(out)
    with pytest.raises(OutputFileError, match="pass --overwrite") as refused:
        write(out)
    assert out.read_bytes() == b"yesterday's results"
    _kept(refused.value).unlink()  # the results of the refused write, kept under the name it gave
    write(out, overwrite=True)
    assert out.read_bytes() != b"yesterday's results" and _mode(out) == 0o640  # its permissions kept
    assert os.listdir(tmp_path) == [name]


def test_a_ray_part_of_ours_is_replaced(tmp_path: Path) -> None:
    """A retried part (its first attempt finished after all) is the same rows: written again."""
    out = tmp_path / "part-000000000000.parquet"
    _write_part(out)
    _write_part(out)
    assert pq.read_table(out).equals(_table())


def test_a_new_output_is_private_while_written_and_never_group_or_world_writable(tmp_path: Path) -> None:
    out = tmp_path / "new" / "out.parquet"
    old = os.umask(0)  # even a umask that lets everyone write
    try:
        with output_file(out) as f:
            pq.write_table(_table(), f)
            f.flush()
            (tmp,) = out.parent.iterdir()
            assert not out.exists() and tmp.name.startswith(".out.parquet.") and _mode(tmp) == 0o600
        assert _mode(out) == 0o644 and _mode(out.parent) == 0o755  # the directory we made too
        os.umask(0o077)
        _write_parquet(tmp_path / "private.parquet")
        assert _mode(tmp_path / "private.parquet") == 0o600
    finally:
        os.umask(old)
    assert pq.read_table(out).equals(_table()) and sorted(os.listdir(out.parent)) == ["out.parquet"]


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    with pytest.raises(RuntimeError, match="generation failed"), output_file(out) as f:
        f.write(b"half a file")
        raise RuntimeError("generation failed")
    assert os.listdir(tmp_path) == []


def test_a_directory_anyone_may_rename_in_is_refused(tmp_path: Path) -> None:
    """0777 without the sticky bit: anyone may swap our temporary file or the output itself."""
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(OutputFileError, match="its directory has mode 0777: anyone may replace files in it"):
        check_output_file(d / "out.parquet")
    with pytest.raises(OutputFileError, match="chmod \\+t"):
        _write_parquet(d / "out.parquet")
    assert os.listdir(d) == []
    d.chmod(0o1777)  # sticky, like /tmp: others may only add names, which are checked
    _write_parquet(d / "out.parquet")
    assert pq.read_table(d / "out.parquet").equals(_table())


def test_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.parquet")
    (tmp_path / "dir.parquet").mkdir()
    for name in ("fifo.parquet", "dir.parquet"):
        with pytest.raises(OutputFileError, match="it exists and is not a regular file"):
            check_output_file(tmp_path / name, overwrite=True)


# --- the `run` command -----------------------------------------------------------------------------


def test_run_refuses_its_output_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], victim: Path
) -> None:
    """`run --model` with an output it would refuse: exit 2 at once, not after starting a stack (the
    model path does not even exist) and generating; the same for an OpenAI Batch input."""
    from moe_lightning.cli import main

    prompts, batch = tmp_path / "p.jsonl", tmp_path / "batch.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    request = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    batch.write_text(json.dumps(request) + "\n")
    existing, link = tmp_path / "out.parquet", tmp_path / "link.jsonl"
    existing.write_bytes(b"keep")
    link.symlink_to(victim)
    model = ["--model", str(tmp_path / "no-such-model")]
    cases = [
        (prompts, existing, "it exists (pass --overwrite to replace it"),
        (batch, link, "it is a symbolic link"),
    ]
    for src, out, why in cases:
        t0 = time.perf_counter()
        assert main(["run", *model, "--input", str(src), "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"refusing to write the output {out}: {why}" in err, err
        assert time.perf_counter() - t0 < 5
    assert main(["run", *model, "--input", str(batch), "--output", str(link), "--overwrite"]) == 2
    assert "it is a symbolic link" in capsys.readouterr().err
    assert existing.read_bytes() == b"keep"
    _untouched(victim)
    ray = ["run", "--ray", "--addr", "x:1", "--input", str(prompts), "--output", str(tmp_path), "--overwrite"]
    assert main(ray) == 2
    assert "a --ray output directory is resumed" in capsys.readouterr().err


# --- rows of the input -----------------------------------------------------------------------------


def _defaults() -> RowDefaults:
    return RowDefaults(max_new_tokens=8, temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=[], ignore_eos=False)


JOB = NodeJob(_defaults(), None, None, False, 64, 0, "")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "hi", "max_new_tokens": "abc"}, "row 17: max_new_tokens must be an integer, got 'abc'"),
        ({"prompt": "hi", "max_new_tokens": 2.5}, "row 17: max_new_tokens must be an integer, got 2.5"),
        ({"prompt": "hi", "max_new_tokens": 2**40}, "row 17: max_new_tokens 1099511627776 is out of range"),
        ({"prompt_ids": [1, "x", 3]}, "row 17: prompt_ids must be a list of integers, got 'x' in it"),
        ({"prompt_ids": "1 2 3"}, "row 17: prompt_ids must be a list of integers, got '1 2 3'"),
        ({"prompt_ids": [1, 2**40]}, "row 17: prompt_ids 1099511627776 is out of range"),
        ({"prompt": 5}, "row 17: prompt must be a string, got 5"),
        ({"prompt": "hi", "temperature": "warm"}, "row 17: temperature must be a number, got 'warm'"),
        ({"prompt": "hi", "top_k": [3]}, "row 17: top_k must be an integer, got \\[3\\]"),
        ({"prompt": "hi", "seed": -1}, "row 17: seed -1 is out of range"),
        ({"prompt": "hi", "ignore_eos": "false"}, "row 17: ignore_eos must be true or false, got 'false'"),
        ({"prompt": "hi", "stop": [1, 2]}, "row 17: stop must be a string or a list of strings"),
        ({"max_new_tokens": 3}, "row 17 has neither prompt nor prompt_ids"),
    ],
)
def test_a_bad_field_names_its_row(row: dict[str, object], message: str) -> None:
    from moe_lightning.batch_rows import row_prompt

    with pytest.raises(ValueError, match=f"^{message}"):
        row_prompt(row, _defaults(), 17)


def test_good_rows_convert_exactly() -> None:
    from moe_lightning.batch_rows import row_prompt

    p = row_prompt({"prompt_ids": [1.0, 2], "max_new_tokens": "12", "seed": 2**63, "stop": "END"}, _defaults(), 0)
    assert p.token_ids == [1, 2] and p.max_new_tokens == 12 and p.seed == 2**63
    assert p.stop == ["END"]  # one stop string, not its letters
    p = row_prompt({"prompt": "hi", "temperature": float("nan"), "ignore_eos": 1}, _defaults(), 1)
    assert p.text == "hi" and p.temperature == 0.0 and p.ignore_eos is True and p.request_id == "row-1"


def test_run_names_the_bad_row_instead_of_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moe_lightning.cli import main

    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "max_new_tokens": ["3", "4", "abc"]}), src)
    out = tmp_path / "out.parquet"
    assert main(["run", "--addr", "127.0.0.1:1", "--input", str(src), "--output", str(out)]) == 2
    assert "error: row 2: max_new_tokens must be an integer, got 'abc'" in capsys.readouterr().err
    assert not out.exists()


def test_the_rows_of_a_ray_part_are_checked_as_a_node_converts_them() -> None:
    from moe_lightning.cluster.node import check_part
    from moe_lightning.cluster.parts import Part

    good, bad = pa.table({"prompt": ["a", "b"]}), pa.table({"prompt": ["a", "b"], "max_new_tokens": ["3", "x"]})
    assert check_part(Part(4, 6), JOB, good) is None
    assert check_part(Part(4, 6), JOB, bad) == "row 5: max_new_tokens must be an integer, got 'x'"
    assert check_part(Part(4, 6), JOB, bad.slice(0, 1), bad.slice(1)) is not None  # a part in two blocks


def test_a_ray_job_refuses_a_bad_row_before_any_stack_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the single-box `run` does: the driver checks every row (a task per part) before it writes
    anything or starts a stack (the model does not even exist), naming the row."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from moe_lightning.cli import main

    src, out = tmp_path / "in.parquet", tmp_path / "out"
    pq.write_table(pa.table({"prompt": list("abcde"), "max_new_tokens": ["3", "4", "5", "abc", "6"]}), src)
    argv = ["run", "--ray", "local", "--model", str(tmp_path / "no-such-model"), "--input", str(src)]
    assert main([*argv, "--output", str(out), "--part-rows", "2", "--no-progress"]) == 2
    assert "error: row 3: max_new_tokens must be an integer, got 'abc'" in capsys.readouterr().err
    assert os.listdir(out) == []  # not even _parts.json
