"""teardown: the groups a script ends are kept, and a process ends without the interpreter's
teardown but with its exit handlers and files flushed (tests/integration/test_teardown_order.py runs
both in real workers, DDP included)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from types import SimpleNamespace

from elastic_launch import teardown


def test_destroying_a_group_keeps_it_and_destroying_all_keeps_them_all(monkeypatch):
    monkeypatch.setattr(teardown, "_kept", [])
    one, two = object(), object()
    destroyed = []
    c10d = types.ModuleType("fake_c10d")
    c10d._world = SimpleNamespace(pg_map={one: "one", two: "two"})
    c10d.destroy_process_group = lambda group=None: destroyed.append(group)
    teardown.keep_destroyed_groups(c10d)
    c10d.destroy_process_group(one)
    assert teardown.kept() == [one] and destroyed == [one], "torch's own still runs"
    c10d.destroy_process_group()
    assert teardown.kept() == [one, two], "each group once"
    wrapped = c10d.destroy_process_group
    teardown.keep_destroyed_groups(c10d)
    assert c10d.destroy_process_group is wrapped, "wrapped once"


def test_a_process_ends_with_its_status_handlers_and_files_but_no_finalizers(tmp_path):
    code = textwrap.dedent(
        f"""
        import atexit, os
        from elastic_launch import teardown

        class Stuck:
            def __del__(self):
                open({str(tmp_path / "finalized")!r}, "w").close()

        stuck = Stuck()
        f = open({str(tmp_path / "buffered")!r}, "w")
        f.write("kept")
        atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").close())
        teardown.end_process(5)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    assert proc.returncode == 5
    assert (tmp_path / "buffered").read_text() == "kept"
    assert (tmp_path / "atexit").exists()
    assert not (tmp_path / "finalized").exists()


def test_flushing_the_files_reads_no_object_s_class_property(tmp_path):
    """Every object alive is looked at: one whose __class__ is a property that warns (torch's
    deprecated names, such as torch.distributed.reduce_op) must not print a warning in every
    worker's last lines. Files are still flushed."""
    import warnings

    class Deprecated:
        @property
        def __class__(self):  # the property torch's deprecated names have
            warnings.warn("deprecated", FutureWarning, stacklevel=2)
            return type(self)

    alive = Deprecated()
    f = open(tmp_path / "f", "w")  # noqa: SIM115 - flushed by the call under test
    f.write("kept")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            teardown._flush_open_files()
        assert (tmp_path / "f").read_text() == "kept"
    finally:
        f.close()
    assert alive is not None


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        timeout=60,
        capture_output=True,
        text=True,
    )


def test_a_freeze_notes_files_only_where_a_descriptor_open_for_writing_could_back_one(tmp_path):
    """Noting the files costs a scan of every object: only when some descriptor beyond
    standard output and error (and the ones the caller names) is a file, pipe or socket open
    for writing, and only among the objects not frozen yet. A file open for reading, or
    /dev/null, is none. What is noted is flushed at the freeze (written once, not again by
    every child)."""
    (tmp_path / "read").write_text("")
    proc = _run(
        f"""
        import json, os, socket
        from elastic_launch import teardown

        def noted(f):
            return any(r() is f for r in teardown._inherited)

        found = []
        readonly = open({str(tmp_path / "read")!r})
        null = open(os.devnull, "w")
        pair = socket.socketpair()
        pipe = os.pipe()
        ours = [*pipe, *(s.fileno() for s in pair)]
        teardown.freeze(ignore=ours)
        found.append(len(teardown._inherited))  # nothing could hold unwritten data
        written = open({str(tmp_path / "written")!r}, "w")
        written.write("before the fork")
        teardown.freeze(ignore=ours)
        found.append(noted(written) and not noted(readonly))  # frozen before: not scanned
        found.append(open({str(tmp_path / "written")!r}).read())  # flushed at the freeze
        before = len(teardown._inherited)
        teardown.freeze(ignore=ours)
        found.append(len(teardown._inherited) - before)  # nothing new to scan
        written.close()
        again = open({str(tmp_path / "read")!r})
        teardown.freeze(ignore=pipe)  # a socket counts
        found.append(noted(again))
        print(json.dumps(found))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [0, True, "before the fork", 0, True]


def test_a_type_that_cannot_be_hashed_does_not_stop_the_scan(tmp_path):
    """A metaclass with __eq__ and no __hash__ makes its classes unhashable: the scan compares
    types by identity, so the zygote's fork and a worker's end go on."""
    proc = _run(
        f"""
        from elastic_launch import teardown

        class Meta(type):
            def __eq__(cls, other):
                return cls is other

        class Odd(metaclass=Meta):
            pass

        odd = Odd()
        f = open({str(tmp_path / "f")!r}, "w")
        f.write("kept")
        teardown.freeze()
        teardown.end_process(0)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "f").read_text() == "kept"


def test_a_pure_python_file_object_is_flushed_too(tmp_path):
    proc = _run(
        f"""
        import _pyio
        from elastic_launch import teardown

        f = _pyio.open({str(tmp_path / "f")!r}, "w")
        f.write("kept")
        teardown.end_process(0)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "f").read_text() == "kept"


def test_a_file_frozen_before_a_fork_is_flushed_as_the_child_ends(tmp_path):
    proc = _run(
        f"""
        import gc, os
        from elastic_launch import teardown

        shared = open({str(tmp_path / "shared")!r}, "w")
        teardown.freeze()
        pid = os.fork()
        if pid == 0:
            assert not any(o is shared for o in gc.get_objects()), "frozen: not scanned"
            shared.write("the child's")
            teardown.end_process(0)
        _, status = os.waitpid(pid, 0)
        raise SystemExit(os.waitstatus_to_exitcode(status))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "shared").read_text() == "the child's"


def test_a_script_s_own_gc_freeze_does_not_hide_its_files(tmp_path):
    """A worker's script may call gc.freeze() itself (before forking its data loaders): the
    files it froze are flushed at its end all the same; unwatched, they would not be."""
    for watched in (True, False):
        target = tmp_path / f"watched-{watched}"
        proc = _run(
            f"""
            import gc
            from elastic_launch import teardown

            if {watched}:
                teardown.watch_freeze()
            f = open({str(target)!r}, "w")
            f.write("kept")
            gc.freeze()
            teardown.end_process(0)
            """
        )
        assert proc.returncode == 0, proc.stderr
        assert target.read_text() == ("kept" if watched else ""), f"watched: {watched}"
