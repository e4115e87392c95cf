"""Weight sync: the actor's weights, per PP stage and in parallel, into every rollout engine.

- ``plan``: the bucket plan (pure), the only contract between ``megatron_workers`` and ``rollout``
  about what moves (they never import each other; both import this package);
- ``group``: a stage's ``WeightSyncGroup`` and the ``StageLink`` its members join by;
- ``transport``: the writer/reader interface; one file per transport, registered in ``factory``,
  which also picks one for ``rollout.weight_transport``;
- ``sides``: the Protocols of the two sides; ``sync``: connect, sync, check, the step's metrics;
- ``checks``: checksums; ``rss``: the peak-memory sampler both sides report.
"""
from .checks import WeightMismatchError, check_engines, checksum, compare_checksums
from .factory import REGISTRY, TRANSPORTS, choose_transport, create_writer, open_reader, open_writer, register
from .group import StageLink, WeightSyncGroup
from .plan import DTYPES, Assembler, Bucket, TensorSpec, plan_buckets, plan_tensors, split_rows, unpack
from .rss import PeakRss
from .sides import StageSource, WeightReceiver, WeightSender
from .sync import connect_weight_sync, sync_metrics, sync_weights
from .transport import StageReader, StageWriter, Transport

__all__ = [
    "DTYPES", "Assembler", "Bucket", "TensorSpec", "plan_buckets", "plan_tensors", "split_rows", "unpack",
    "StageLink", "WeightSyncGroup", "PeakRss",
    "WeightMismatchError", "check_engines", "checksum", "compare_checksums",
    "REGISTRY", "TRANSPORTS", "choose_transport", "create_writer", "open_reader", "open_writer", "register",
    "StageReader", "StageWriter", "Transport",
    "StageSource", "WeightReceiver", "WeightSender",
    "connect_weight_sync", "sync_metrics", "sync_weights",
]
