"""The clients of etcd: the v3 API (gRPC, also the embedded service's client), its watches and
leases, and the v2 API."""
