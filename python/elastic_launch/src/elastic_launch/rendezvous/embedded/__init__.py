"""The embedded rendezvous service: an etcd-v3 subset served by the agents themselves, its hosting
roles, standbys and successor, and the bounds it keeps."""
