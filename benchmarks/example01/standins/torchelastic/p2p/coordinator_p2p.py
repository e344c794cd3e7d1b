"""torchelastic.p2p.coordinator_p2p."""

from elastic_launch.train_loop.coordinator import CoordinatorP2P

__all__ = ["CoordinatorP2P"]
