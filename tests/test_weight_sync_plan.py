"""The weight-sync plan on its own (no processes): buckets never exceed their size, tensors larger
than a bucket travel in row pieces that a receiver reassembles exactly, and malformed plans are
refused with the tensor named."""
from __future__ import annotations

import pytest
import torch

from rlcore.weight_sync import Assembler, Bucket, TensorSpec, plan_buckets, plan_tensors, split_rows, unpack


def _specs():
    return [TensorSpec("a", (10, 4), "float32"), TensorSpec("big", (100, 8), "float32"),
            TensorSpec("b", (3,), "float32"), TensorSpec("wide", (2, 600), "float32")]


def test_buckets_stay_within_their_size_and_pieces_cover_each_tensor():
    bucket_bytes = 1000  # 'big' is 3200 bytes: pieces of 31 rows; one row of 'wide' is 2400 bytes
    plan = plan_buckets(_specs(), bucket_bytes)
    pieces = [t for b in plan for t in b.tensors if t.name == "big"]
    assert [t.rows for t in pieces] == [(0, 31), (31, 62), (62, 93), (93, 100)]
    # Every bucket fits, except the one holding a single row larger than a bucket.
    assert all(b.numel * 4 <= bucket_bytes for b in plan if not any(t.name == "wide" for t in b.tensors))
    assert [t.rows for b in plan for t in b.tensors if t.name == "wide"] == [(0, 1), (1, 2)]
    assert [(t.name, t.shape, t.rows) for t in plan_tensors(plan)] == [(s.name, s.shape, None) for s in _specs()]
    assert split_rows(TensorSpec("small", (2, 2), "float32"), 1000) == [TensorSpec("small", (2, 2), "float32")]


def test_a_receiver_reassembles_split_tensors_bit_exactly():
    g = torch.Generator().manual_seed(0)
    tensors = {s.name: torch.randn(s.shape, generator=g) for s in _specs()}
    plan = plan_buckets(_specs(), 1000)
    assemble, got = Assembler(copy_out=False), {}
    for bucket in plan:  # what a sender packs: each spec's rows of its tensor, in order
        buf = torch.cat([(tensors[t.name] if t.rows is None else tensors[t.name][t.rows[0]:t.rows[1]]).reshape(-1)
                         for t in bucket.tensors])
        for name, t in assemble(unpack(bucket, buf)):
            assert name not in got
            got[name] = t.clone()
    assert sorted(got) == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(got[name], t), name


def test_malformed_plans_name_the_tensor():
    piece = TensorSpec("w", (4, 2), "float32", (0, 2))
    with pytest.raises(ValueError, match="w stops at row 2 of 4"):
        plan_tensors([Bucket("float32", (piece, TensorSpec("x", (1,), "float32")))])
    with pytest.raises(ValueError, match="w ends at row 2 of 4"):
        plan_tensors([Bucket("float32", (piece,))])
    with pytest.raises(ValueError, match="w starts at row 2"):
        plan_tensors([Bucket("float32", (TensorSpec("w", (4, 2), "float32", (2, 4)),))])


def test_shm_transport_is_refused_off_one_cpu_node():
    """The transport decision comes before anything is set up; shm needs the cpu profile and one node."""
    from types import SimpleNamespace

    from rlcore.weight_sync import connect_weight_sync

    receivers = SimpleNamespace(num_engines=1, node_ips=lambda: ["10.0.0.2"])
    for profile, ips in (("cpu", ["10.0.0.1"]), ("gpu", ["10.0.0.2"])):
        senders = SimpleNamespace(profile=profile, node_ips=lambda ips=ips: ips)
        with pytest.raises(ValueError, match="rollout.weight_transport=shm needs the cpu profile and the actor "
                                             "and rollout on one node"):
            connect_weight_sync(senders, receivers, 1, 1 << 20, "float32", transport="shm")
    with pytest.raises(ValueError, match="rollout.weight_transport='tcp': expected one of"):
        connect_weight_sync(senders, receivers, 1, 1 << 20, "float32", transport="tcp")


def test_the_factory_picks_auto_as_documented_and_rejects_unknown_names():
    """auto: shm on the cpu profile when every member is on one node, else broadcast; a forced name is
    kept where it can serve; an unknown one is refused with the accepted names."""
    from rlcore.weight_sync import TRANSPORTS, choose_transport

    assert TRANSPORTS == ("auto", "shm", "broadcast")
    assert choose_transport("auto", "cpu", {"10.0.0.1"}) == "shm"
    assert choose_transport("auto", "cpu", {"10.0.0.1", "10.0.0.2"}) == "broadcast"
    assert choose_transport("auto", "gpu", {"10.0.0.1"}) == "broadcast"
    assert choose_transport("broadcast", "cpu", {"10.0.0.1"}) == "broadcast"
    assert choose_transport("shm", "cpu", {"10.0.0.1"}) == "shm"
    with pytest.raises(ValueError, match=r"rollout.weight_transport='tcp': expected one of \['auto', 'shm', "
                                         r"'broadcast'\]"):
        choose_transport("tcp", "cpu", {"10.0.0.1"})
    with pytest.raises(ValueError, match="rollout.weight_transport=shm needs the cpu profile"):
        choose_transport("shm", "gpu", {"10.0.0.1"})


def test_the_registry_refuses_a_second_transport_of_one_name():
    from rlcore.registry import DuplicateNameError, Registry
    from rlcore.weight_sync import REGISTRY, Transport, register

    registry = Registry("rollout.weight_transport")
    for t in REGISTRY.values():
        register(t, registry)
    twin = type("Twin", (Transport,), {"name": "shm"})
    with pytest.raises(DuplicateNameError, match="rollout.weight_transport: 'shm' is already registered"):
        register(twin, registry)
    with pytest.raises(ValueError, match="'auto' is reserved"):
        register(type("Auto", (Transport,), {"name": "auto"}), registry)
    assert list(registry) == list(REGISTRY)


def test_a_steps_sync_metrics_take_the_slowest_side_and_sum_the_engines_page_faults():
    """rlcore.weight_sync.sync_metrics: the slowest engine's load and wait, the slowest sender's
    gather + packing and wait, the engines' page faults summed; none without reports, and no fault
    count unless every engine reported one; the checked tensors' count only after a checked sync."""
    from rlcore.weight_sync import sync_metrics

    send = [{"gather_s": 0.0, "pack_s": 0.2, "send_wait_s": 1.1}, {"gather_s": 0.5, "pack_s": 0.1, "send_wait_s": 0.7}]
    reports = [{"load_s": 1.5, "recv_wait_s": 0.01, "page_faults": 1000, "send": send},
               {"load_s": 1.25, "recv_wait_s": 0.25, "page_faults": 24, "send": send}]
    assert sync_metrics(reports) == {"weight_sync/load_s": 1.5, "weight_sync/recv_wait_s": 0.25,
                                     "weight_sync/pack_s": 0.6, "weight_sync/send_wait_s": 1.1,
                                     "weight_sync/recv_page_faults": 1024.0}
    del reports[1]["page_faults"]
    assert "weight_sync/recv_page_faults" not in sync_metrics(reports)
    assert sync_metrics([]) == {}
    # rollout.check_weights: the count of tensors compared, a deterministic metric.
    checked = [{**r, "checked_tensors": 272} for r in reports]
    assert sync_metrics(checked)["weights/checked_tensors"] == 272.0
    assert "weights/checked_tensors" not in sync_metrics(reports)


def test_the_checksum_is_the_positional_sum_however_the_tensor_is_chunked(monkeypatch):
    """``checksum`` (``rollout.check_weights``, both sides of a sync) is sum(x) + sum(x_i * i / n) in
    float64 over the flattened tensor, 1-based i, taken in chunks: across several chunks and a short
    last one it equals the formula on the whole tensor, a swap of two values changes it, and the same
    tensor gives the same bits (as the sender and an engine each compute it)."""
    from rlcore.weight_sync import checks

    monkeypatch.setattr(checks, "CHECKSUM_CHUNK", 64)  # 37 x 11 = 407 elements: 7 chunks, the last of 23
    x = torch.randn(37, 11, generator=torch.Generator().manual_seed(0))
    flat = x.double().reshape(-1)
    pos = torch.arange(1, flat.numel() + 1, dtype=torch.float64) / flat.numel()
    want = float(flat.sum() + (flat * pos).sum())
    got = checks.checksum([("w", x)])["w"]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert checks.checksum([("w", x.clone())])["w"] == got
    swapped = x.clone().reshape(-1)
    swapped[[3, 300]] = swapped[[300, 3]]
    assert checks.checksum([("w", swapped.reshape(37, 11))])["w"] != pytest.approx(got, rel=1e-9)


def test_the_cpu_profile_packs_a_sync_with_one_thread_and_gives_the_rank_its_threads_back():
    from types import SimpleNamespace

    from megatron_workers.weight_sender import StageWeightSender

    seen = []

    class Writer:
        joined, link = True, SimpleNamespace(transport="shm")

        def send(self, source, with_checksums):
            seen.append(torch.get_num_threads())
            return {"bytes": 0}

    coords = {"rank": 0, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for profile, threads_while_packing in (("cpu", 1), ("gpu", 2)):
            sender = StageWeightSender([], None, coords, 1, profile, "cpu", lambda: ("127.0.0.1", 0))
            sender.writer = Writer()
            assert sender.send_weights()["transport"] == "shm"
            assert seen[-1] == threads_while_packing and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
