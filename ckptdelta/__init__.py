"""ckptdelta: bit-exact policy weights from an RL trainer to its replicas, as small deltas through object storage."""

__version__ = "0.1.0"
