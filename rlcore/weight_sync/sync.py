"""The controller's side of weight sync: connect the actor's stage senders with the rollout engines,
then sync (and check) once per step. It talks to the two sides only through ``sides.WeightSender``
and ``sides.WeightReceiver``."""
from __future__ import annotations

from .checks import check_engines
from .factory import choose_transport
from .sides import WeightReceiver, WeightSender


def connect_weight_sync(senders: WeightSender, receivers: WeightReceiver, num_receivers: int, bucket_bytes: int,
                        wire_dtype: str, transport: str = "auto") -> list:
    """Builds one weight-sync group per actor PP stage: that stage's writers plus every vLLM worker
    of every rollout engine. ``num_receivers`` is the number of engines (each joins with its ``tp``
    workers). ``transport`` (``rollout.weight_transport``): a registered name, or ``auto``
    (``factory.choose_transport``: decided from the profile and the nodes before anything is set up).
    Both sides block in group creation until all members join, hence one ray.get. Calling it again
    (a new actor, a new bucket size) replaces the groups. Returns the links."""
    import ray

    if num_receivers != receivers.num_engines:
        raise ValueError(f"weight sync: num_receivers={num_receivers}, but the rollout pool has "
                         f"{receivers.num_engines} engines")
    nodes = set(senders.node_ips()) | set(receivers.node_ips())
    transport = choose_transport(transport, senders.profile, nodes)
    plans = senders.weight_sync_plans(bucket_bytes, wire_dtype)
    links = senders.weight_sync_links(transport, receivers.num_receiving_ranks)
    ray.get(senders.init_weight_sync(links) + receivers.init_weight_sync(links, plans))
    return links


def sync_weights(senders: WeightSender, receivers: WeightReceiver, version: int, check: bool = False) -> list:
    """Sends the actor's current weights to every engine; returns the receivers' reports (each with
    the senders' ``send`` stats added). With ``check`` (``rollout.check_weights``), compares every
    engine's weights afterwards with what the senders packed and raises ``WeightMismatchError``
    naming the first tensor that differs."""
    import ray

    refs_out = senders.send_weights(with_checksums=check)
    refs_in = receivers.receive_weights(version)
    sent = [s for s in ray.get(refs_out) if s is not None]
    reports = ray.get(refs_in)
    for r in reports:
        r["send"] = [{k: v for k, v in s.items() if k != "checksums"} for s in sent]
    if check:
        expected, order = {}, []
        for s in sent:
            expected.update(s["checksums"])
            order.extend(s["checksums"])
        check_engines(expected, receivers.weight_checksums(), order)
    return reports
