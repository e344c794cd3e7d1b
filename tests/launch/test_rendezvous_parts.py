"""Rendezvous pieces: rank assignment, settings, and the backend registry (entry points too)."""

from __future__ import annotations

import sys
import textwrap

import pytest
from elastic_launch.rendezvous import (
    RendezvousConfigError,
    RendezvousParameters,
    backends,
    create_handler,
    register,
)
from elastic_launch.rendezvous.elastic import Timeouts, assign_ranks


def params(backend: str, **kw) -> RendezvousParameters:
    base = dict(
        backend=backend, endpoint="", run_id="r", min_nodes=1, max_nodes=1, local_world_size=1
    )
    base.update(kw)
    return RendezvousParameters(**base)


def test_survivors_keep_their_ranks():
    assert assign_ranks(["a", "b", "c"], {}) == {"a": 0, "b": 1, "c": 2}
    # b (rank 1) died; a spare s arrives: a and c keep 0 and 2, s takes 1.
    assert assign_ranks(["a", "c", "s"], {"a": 0, "b": 1, "c": 2}) == {"a": 0, "c": 2, "s": 1}
    # Shrinking to two: c's old rank 2 is out of range, it takes the free one.
    assert assign_ranks(["a", "c"], {"a": 0, "b": 1, "c": 2}) == {"a": 0, "c": 1}


def test_timeouts_from_config():
    t = Timeouts.from_config({"join_timeout": "30", "last_call_timeout": "1"})
    assert (t.join, t.last_call, t.heartbeat) == (30.0, 1.0, 5.0)
    with pytest.raises(RendezvousConfigError, match="at least 2 seconds"):
        Timeouts.from_config({"heartbeat_timeout": 1})


def test_registered_backend():
    class Handler:
        def __init__(self, p):
            self.p = p

    register("mine", Handler)
    assert "mine" in backends()
    assert isinstance(create_handler(params("mine")), Handler)


def test_entry_point_backend(tmp_path, monkeypatch):
    pkg = tmp_path / "site"
    (pkg / "outside_rdzv-1.0.dist-info").mkdir(parents=True)
    (pkg / "outside_rdzv-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: outside-rdzv\nVersion: 1.0\n"
    )
    (pkg / "outside_rdzv-1.0.dist-info" / "entry_points.txt").write_text(
        "[elastic_launch.rendezvous]\nzookeeper = outside_rdzv:create\n"
    )
    (pkg / "outside_rdzv.py").write_text(
        textwrap.dedent("""
        def create(params):
            return ("handler for", params.run_id)
    """)
    )
    monkeypatch.syspath_prepend(str(pkg))
    assert "zookeeper" in backends()
    assert create_handler(params("zookeeper")) == ("handler for", "r")
    sys.modules.pop("outside_rdzv", None)


def test_unknown_backend_and_bad_keys():
    with pytest.raises(RendezvousConfigError, match="'nope' is not a rendezvous backend"):
        create_handler(params("nope"))
    with pytest.raises(RendezvousConfigError, match="'color' is not an option of the static"):
        create_handler(params("static", config={"color": "red"}))
    with pytest.raises(RendezvousConfigError, match="rank='x' is not valid"):
        create_handler(params("static", config={"rank": "x"}))
