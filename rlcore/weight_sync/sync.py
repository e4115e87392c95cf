"""The controller's side of weight sync: connect the actor's stage senders with the rollout engines,
then sync (and check) once per step. It talks to the two sides only through ``sides.WeightSender``
and ``sides.WeightReceiver``.

Every wait is bounded (``timeout_s``, ``rollout.sync_timeout_s``): the links carry it to every member,
where it bounds the group's joining and each collective, and the controller waits at most that long
(plus a grace for the members' own timeouts to fire first) for a setup or a sync. A member whose
process died is named: an engine as ``EngineDied`` (the engine restart policy restarts it), an actor
rank as ``RankDied``; a member that failed or never finished as ``WeightSyncError``."""
from __future__ import annotations

import dataclasses
import time

from rlcore.faults import EngineDied, RankDied, WeightSyncError

from .checks import check_engines
from .factory import choose_transport
from .sides import WeightReceiver, WeightSender

DEFAULT_TIMEOUT_S = 600.0  # rollout.sync_timeout_s's default
GRACE_S = 30.0  # the controller waits this much past the members' own timeout, so theirs fires first


def connect_weight_sync(senders: WeightSender, receivers: WeightReceiver, num_receivers: int, bucket_bytes: int,
                        wire_dtype: str, transport: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    """Builds one weight-sync group per actor PP stage: that stage's writers plus every vLLM worker
    of every rollout engine. ``num_receivers`` is the number of engines (each joins with its ``tp``
    workers). ``transport`` (``rollout.weight_transport``): a registered name, or ``auto``
    (``factory.choose_transport``: decided from the profile and the nodes before anything is set up).
    Both sides block in group creation until all members join, hence one wait. Calling it again
    (a new actor, a new bucket size, a restarted engine) replaces the groups. Returns the links."""
    if num_receivers != receivers.num_engines:
        raise ValueError(f"weight sync: num_receivers={num_receivers}, but the rollout pool has "
                         f"{receivers.num_engines} engines")
    nodes = set(senders.node_ips()) | set(receivers.node_ips())
    transport = choose_transport(transport, senders.profile, nodes)
    plans = senders.weight_sync_plans(bucket_bytes, wire_dtype)
    links = [dataclasses.replace(link, timeout_s=float(timeout_s))
             for link in senders.weight_sync_links(transport, receivers.num_receiving_ranks)]
    await_members(senders, senders.init_weight_sync(links), receivers.init_weight_sync(links, plans),
                  "the weight-sync group setup", timeout_s)
    return links


def sync_weights(senders: WeightSender, receivers: WeightReceiver, version: int, check: bool = False,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    """Sends the actor's current weights to every engine; returns the receivers' reports (each with
    the senders' ``send`` stats added). With ``check`` (``rollout.check_weights``), compares every
    engine's weights afterwards with what the senders packed and raises ``WeightMismatchError``
    naming the first tensor that differs."""
    refs_out = senders.send_weights(with_checksums=check)
    refs_in = receivers.receive_weights(version)
    sent, reports = await_members(senders, refs_out, refs_in, f"the weight sync to version {version}", timeout_s)
    sent = [s for s in sent if s is not None]
    for r in reports:
        r["send"] = [{k: v for k, v in s.items() if k != "checksums"} for s in sent]
    if check:
        expected, order = {}, []
        for s in sent:
            expected.update(s["checksums"])
            order.extend(s["checksums"])
        check_engines(expected, receivers.weight_checksums(), order)
        for r in reports:
            r["checked_tensors"] = len(expected)
    return reports


def sync_metrics(reports: list) -> dict[str, float]:
    """A step's ``weight_sync/*`` metrics from ``sync_weights``' reports: the slowest engine's load
    (``load_s``: its loader's time, arrivals excluded) and wait for arrivals (``recv_wait_s``), the
    slowest sender's packing (``pack_s``: TP gather and renaming included) and wait (``send_wait_s``:
    for the receivers to take its buckets), and the minor page faults of the receiving processes
    during the sync, summed (``recv_page_faults``: pages the kernel had to map and zero-fill, each
    a few microseconds; on the cpu profile a reload allocates most of the model afresh). With
    ``rollout.check_weights``, ``weights/checked_tensors``: how many tensors each engine's checksums
    were compared on (a machine-independent count, so not under ``weight_sync/``)."""
    if not reports:
        return {}
    sent = reports[0].get("send", [])
    m = {"weight_sync/load_s": max(r["load_s"] for r in reports),
         "weight_sync/recv_wait_s": max(r["recv_wait_s"] for r in reports)}
    if sent:
        m["weight_sync/pack_s"] = max(s.get("gather_s", 0.0) + s["pack_s"] for s in sent)
        m["weight_sync/send_wait_s"] = max(s["send_wait_s"] for s in sent)
    if all("page_faults" in r for r in reports):
        m["weight_sync/recv_page_faults"] = float(sum(r["page_faults"] for r in reports))
    if all("checked_tensors" in r for r in reports):
        m["weights/checked_tensors"] = float(min(r["checked_tensors"] for r in reports))
    return m


def await_members(senders: WeightSender, sender_refs: list, engine_refs: list, what: str,
                  timeout_s: float) -> tuple[list, list]:
    """The results of every sender rank's and every engine's part of ``what`` (refs, in rank and
    engine order), once all are done, but at most ``timeout_s`` + ``GRACE_S``. A member whose process
    died is ``RankDied`` or ``EngineDied`` (raised once the others are done: they fail too, within
    their collectives' timeout, and are free again then); a member that raised otherwise is
    ``WeightSyncError`` naming it and the cause, and so is one that had not finished in time."""
    import ray

    role = senders.role
    members = [(f"{role} rank {i}", ref) for i, ref in enumerate(sender_refs)] + \
              [(f"rollout engine {e}", ref) for e, ref in enumerate(engine_refs)]
    index = {ref: i for i, (_, ref) in enumerate(members)}
    results: list = [None] * len(members)
    failed: list[tuple[str, BaseException]] = []
    died: RankDied | EngineDied | None = None
    pending = [ref for _, ref in members]
    deadline = time.monotonic() + timeout_s + GRACE_S
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for ref in ready:
            i = index[ref]
            try:
                results[i] = ray.get(ref)
            except ray.exceptions.RayActorError:
                if i < len(sender_refs):
                    died = died if isinstance(died, RankDied) else RankDied(role, i, what)
                elif not isinstance(died, RankDied):
                    engines = [] if died is None else died.engines
                    died = EngineDied(engines + [i - len(sender_refs)], what)
            except Exception as e:  # a dead peer's members fail too: the death is the cause
                failed.append((members[i][0], e))
    if died is not None:
        raise died
    if failed:
        name, e = failed[0]
        raise WeightSyncError(f"{what} failed on {name}: {first_line(e)}") from e
    if pending:
        late = [members[index[ref]][0] for ref in pending]
        raise WeightSyncError(f"{what}: {', '.join(late)} did not finish within rollout.sync_timeout_s="
                              f"{timeout_s:g} s (+{GRACE_S:g} s)")
    return results[:len(sender_refs)], results[len(sender_refs):]


def first_line(e: BaseException) -> str:
    """The original exception of a Ray task error, as one line."""
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"
