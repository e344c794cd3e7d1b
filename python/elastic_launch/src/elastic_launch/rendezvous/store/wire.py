"""What the embedded rendezvous service and its clients agree on beyond etcd's own API: how the
service names itself, where a standby's refusal says who hosts, and how long a lease can last."""

from __future__ import annotations

#: What the embedded service's Status says it is: clients tell it from etcd by it.
EMBEDDED_VERSION = "elasticrun-embedded"
#: A standby's refusal names the host (HOST:PORT) and the cluster id it belongs to (hex) in
#: the call's trailing metadata, under these keys: a client that knew only the standby finds
#: the host.
HOST_KEY = "elasticrun-host"
CLUSTER_KEY = "elasticrun-cluster"
#: Where the agents of a job with one endpoint publish the successor they chose: a service
#: that keeps a synchronous copy of the host's state and takes over when the host is lost.
SUCCESSOR_KEY = "/elasticrun-service/successor"
#: The longest lease the embedded service grants, in seconds (etcd's is 9e9): a departed
#: client's leases end within it. A rendezvous asks for its heartbeat_timeout (5 s by
#: default), which may not be longer.
MAX_TTL = 3600
