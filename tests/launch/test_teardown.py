"""teardown: the groups a script ends are kept, and a process ends without the interpreter's
teardown but with its exit handlers and files flushed (tests/integration/test_teardown_order.py runs
both in real workers, DDP included)."""

from __future__ import annotations

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
