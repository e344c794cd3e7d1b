"""The backend registry: built-in names, registered factories, entry points, clear errors."""

from __future__ import annotations

import sys
import textwrap

import pytest
from elastic_launch.rendezvous import (
    RendezvousConfigError,
    RendezvousParameters,
    backend_names,
    create_handler,
    register,
)
from elastic_launch.rendezvous.local import LocalRendezvous
from elastic_launch.rendezvous.static import StaticRendezvous


def params(backend: str, **kw) -> RendezvousParameters:
    base = dict(
        backend=backend, endpoint="", run_id="r", min_nodes=1, max_nodes=1, local_world_size=1
    )
    base.update(kw)
    return RendezvousParameters(**base)


def test_built_in_backends():
    assert {"embedded", "c10d", "etcd", "etcd-v2", "static"} <= set(backend_names())
    assert isinstance(create_handler(params("c10d")), LocalRendezvous), "one node: no service"
    assert isinstance(create_handler(params("static")), StaticRendezvous)


def test_registered_backend():
    class Handler(LocalRendezvous):
        pass

    register("mine", Handler)
    assert "mine" in backend_names()
    assert isinstance(create_handler(params("mine")), Handler)


def test_a_backend_that_gives_no_handler_is_a_clear_error():
    class NotAHandler:
        def __init__(self, p):
            self.p = p

    register("broken", NotAHandler)
    with pytest.raises(RendezvousConfigError, match="'broken' gave NotAHandler, which lacks"):
        create_handler(params("broken"))


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
        from elastic_launch.rendezvous.local import LocalRendezvous

        class Zookeeper(LocalRendezvous):
            pass

        def create(params):
            return Zookeeper(params)
    """)
    )
    monkeypatch.syspath_prepend(str(pkg))
    assert "zookeeper" in backend_names()
    handler = create_handler(params("zookeeper"))
    assert type(handler).__name__ == "Zookeeper" and handler.get_run_id() == "r"
    sys.modules.pop("outside_rdzv", None)


def test_unknown_backend_and_bad_keys():
    with pytest.raises(RendezvousConfigError, match="'nope' is not a rendezvous backend"):
        create_handler(params("nope"))
    with pytest.raises(RendezvousConfigError, match="'color' is not an option of the static"):
        create_handler(params("static", config={"color": "red"}))
    with pytest.raises(RendezvousConfigError, match="rank='x' is not valid"):
        create_handler(params("static", config={"rank": "x"}))
    with pytest.raises(RendezvousConfigError, match="needs --rdzv-endpoint"):
        create_handler(params("embedded", max_nodes=2))


def test_a_multi_node_static_job_says_what_its_workers_wait_for(caplog):
    handler = create_handler(
        params("static", min_nodes=2, max_nodes=2, node_rank=1, master_addr="10.0.0.5")
    )
    with caplog.at_level("WARNING", logger="elasticrun"):
        info = handler.next_rendezvous()
        handler.next_rendezvous()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "this is node 1 of 2" in line and "10.0.0.5:29500" in line
    assert "--node-rank" in line and info.group_rank == 1


def test_an_embedded_service_asked_for_more_nodes_than_measured_says_to_use_etcd(caplog):
    from elastic_launch.net import free_port

    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    for most, warned in ((512, False), (2000, True)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="elastic_launch"):
            handler = create_handler(
                params(
                    "embedded",
                    endpoint=endpoint,
                    min_nodes=2,
                    max_nodes=most,
                    local_addr="127.0.0.1",
                )
            )
            handler.shutdown()
        said = [r.getMessage() for r in caplog.records if "measured to serve" in r.getMessage()]
        assert bool(said) == warned, said
    assert "--nnodes 2:2000" in said[0] and "--rdzv-backend etcd" in said[0]
