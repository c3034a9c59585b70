"""Bulk tensor links (transport/bulk.py) with real gloo process groups in 2-3 forked processes."""

from __future__ import annotations

import functools
import gc
import multiprocessing as mp
import os
import traceback
from typing import Any, Callable

import pytest
import torch

from transport.bulk import (BulkError, BulkLink, ChecksumMismatch, LinkConfig, LinkRendezvousError,
                            bucket_checksum, pack_bucket, pack_to_host, unpack_bucket)
from transport.ports import free_port

CTX = mp.get_context("fork")  # the parent has torch imported already: forking is ~100x cheaper than spawn
WAIT_S = 60


def make_bucket(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("layer.0.weight", torch.randn(33, 17, generator=g)),
        ("layer.0.bias", torch.randn(17, generator=g).to(torch.bfloat16)),
        ("step", torch.tensor(seed, dtype=torch.int64)),          # 0-dim
        ("empty", torch.empty(0, 5)),
        ("mask", torch.rand(7, generator=g) > 0.5),
        ("half", torch.randn(3, 3, generator=g).half()),
    ]


def same_bucket(a: list, b: list) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


def config(name: str, port: int, rank: int, world: int) -> LinkConfig:
    return LinkConfig(name=name, backend="gloo", master_addr="127.0.0.1", master_port=port, rank=rank,
                      world_size=world, timeout_s=30, env={"GLOO_TEST_MARKER": name})


def _report(queue: Any, i: int, fn: Callable[[], Any]) -> None:
    try:
        queue.put((i, "ok", fn()))
    except BaseException as exc:  # report to the parent rather than dying silently
        queue.put((i, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_procs(targets: list[Callable[..., Any]], ctx: Any = CTX) -> list[Any]:
    """Run each target in its own process (forked; `spawn` for CUDA, with picklable targets); return what
    each returned (or raise with its traceback)."""
    gc.collect()   # no gloo device or store thread of an earlier test's failed formation lives on into a fork
    queue = ctx.Queue()
    procs = [ctx.Process(target=_report, args=(queue, i, fn)) for i, fn in enumerate(targets)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            i, status, value = queue.get(timeout=WAIT_S)
            if status == "err":
                raise AssertionError(f"process {i} failed: {value}")
            results[i] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[i] for i in range(len(targets))]


def test_pack_roundtrip_and_corruption_in_process() -> None:
    bucket = make_bucket(1)
    packed = pack_bucket(bucket, bucket_id=7)
    assert same_bucket(unpack_bucket(packed), bucket)
    assert all(e["offset"] % 16 == 0 for e in packed.header["tensors"])
    # the padding between aligned tensors is zeroed, so a bucket always packs to the same bytes
    odd = [("a", torch.ones(3, dtype=torch.uint8)), ("b", torch.ones(5, dtype=torch.int16))]
    first, second = pack_bucket(odd), pack_bucket(odd)
    assert torch.equal(first.flat, second.flat) and first.flat[3:16].eq(0).all()
    assert first.header["checksum"] == second.header["checksum"] and first.header["algo"] == "xxh3_64"
    packed.flat[3] ^= 0xFF
    with pytest.raises(ChecksumMismatch, match=r"bucket 7 checksum mismatch.*layer\.0\.weight"):
        unpack_bucket(packed, link="weights")


class DeferredCopier:
    """Moves bytes only when waited for, as a GPU copy stream finishes later; counts the copies pending."""

    def __init__(self) -> None:
        self.pending = 0
        self.done = 0

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
        self.pending += 1

        def wait() -> None:
            for dst, src in pairs:
                dst.copy_(src)
            self.pending -= 1
            self.done += 1
        return wait


def test_pack_to_host_holds_a_few_exported_buckets_and_packs_what_pack_bucket_packs() -> None:
    buckets = [make_bucket(seed) for seed in range(7)]
    copier = DeferredCopier()
    held: list[int] = []

    def export():   # what an engine's export_weights does: one bucket at a time, made as it is asked for
        for bucket in buckets:
            yield bucket
            held.append(len(held) + 1 - copier.done)   # exported, not yet copied off the "GPU"

    packed = list(pack_to_host(export(), in_flight=2, copier=copier))
    assert max(held) <= 3, held          # in_flight copying + the one just exported, not the whole version
    assert copier.pending == 0 and len(packed) == len(buckets)
    for i, (got, bucket) in enumerate(zip(packed, buckets)):
        ref = pack_bucket(bucket, i)
        assert got.header == ref.header and torch.equal(got.flat, ref.flat)
        assert same_bucket(unpack_bucket(got), bucket)
    # the default (no copier) packs buckets in host memory at once, numbered from first_id
    [p] = pack_to_host([buckets[0]], first_id=5)
    assert p.header == pack_bucket(buckets[0], 5).header
    with pytest.raises(BulkError, match="empty bucket"):
        list(pack_to_host([[]]))


def test_receiver_verifies_with_the_algorithm_the_sender_named() -> None:
    """A GPU sender checksums with `wsum` on its device; a CPU receiver (a parameter server on a gloo link)
    must verify with the same algorithm, not its own default."""
    bucket = make_bucket(2)
    packed = pack_bucket(bucket)
    packed.header.update(algo="wsum", checksum=bucket_checksum(packed.flat, "wsum"))  # as a CUDA sender writes it
    assert packed.header["checksum"] != bucket_checksum(packed.flat)  # the CPU default would disagree
    assert same_bucket(unpack_bucket(packed), bucket)
    packed.flat[5] ^= 0x01
    with pytest.raises(ChecksumMismatch):
        unpack_bucket(packed)
    packed.header["algo"] = "md5"
    with pytest.raises(BulkError, match="link 'w': bucket 0: unknown bucket checksum algorithm 'md5'"):
        unpack_bucket(packed, link="w")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_sender(port: int, nccl_port: int) -> bool:
    link = BulkLink(config("mixed", port, 0, 2))
    link.open(0)
    link.send([(n, t.cuda()) for n, t in make_bucket(3)], dst=1)
    solo = BulkLink(LinkConfig(name="solo", backend="nccl", master_addr="127.0.0.1", master_port=nccl_port,
                               rank=0, world_size=1, timeout_s=30))
    solo.open(0)
    packed = pack_bucket([(n, t.cuda()) for n, t in make_bucket(3)])
    got = unpack_bucket(solo.broadcast_packed(packed), "solo")
    return packed.header["algo"] == "wsum" and all(t.is_cuda for _, t in got) and same_bucket(
        [(n, t.cpu()) for n, t in got], make_bucket(3))


def _cpu_receiver(port: int) -> bool:
    link = BulkLink(config("mixed", port, 1, 2))
    link.open(0)
    return same_bucket(link.recv(src=0), make_bucket(3))


@needs_cuda
def test_gpu_bucket_over_gloo_and_nccl_links() -> None:
    """A trainer on a GPU in a gloo link (its tensors go to host memory for gloo) and in an NCCL link of
    one (tensors stay on the GPU; the checksum is computed there)."""
    port, nccl_port = free_port(), free_port()
    targets = [functools.partial(_gpu_sender, port, nccl_port), functools.partial(_cpu_receiver, port)]
    assert run_procs(targets, ctx=mp.get_context("spawn")) == [True, True]


def test_bad_inputs_are_typed_errors() -> None:
    with pytest.raises(BulkError, match="backend must be gloo or nccl"):
        LinkConfig(name="x", backend="mpi", master_addr="h", master_port=1, rank=0, world_size=1)
    with pytest.raises(BulkError, match="rank 3 outside world size 2"):
        LinkConfig(name="x", backend="gloo", master_addr="h", master_port=1, rank=3, world_size=2)
    with pytest.raises(BulkError, match=r"unknown key\(s\) \['colour'\]"):
        LinkConfig.from_dict({"name": "x", "backend": "gloo", "master_addr": "h", "master_port": 1,
                              "rank": 0, "world_size": 1, "colour": "red"})
    with pytest.raises(BulkError, match="'w' is list, not a tensor"):
        pack_bucket([("w", [1, 2])])
    with pytest.raises(BulkError, match="not open"):
        BulkLink(config("x", 1, 0, 1)).broadcast([("a", torch.zeros(1))])


def test_bucketed_broadcast_and_send_recv_three_ranks() -> None:
    port = free_port()

    def member(rank: int) -> dict:
        link = BulkLink(config("weights", port, rank, 3))
        link.open(epoch=0)
        got = [link.broadcast(make_bucket(seed) if rank == 0 else None, src=0) for seed in range(3)]
        ok = all(same_bucket(b, make_bucket(seed)) for seed, b in enumerate(got))
        p2p = None
        if rank == 2:
            link.send(make_bucket(99), dst=1)
        elif rank == 1:
            p2p = same_bucket(link.recv(src=2), make_bucket(99))
        link.barrier()
        return {"ok": ok, "p2p": p2p, "env": os.environ.get("GLOO_TEST_MARKER"), "epoch": link.epoch}

    results = run_procs([lambda r=r: member(r) for r in range(3)])
    assert all(r["ok"] for r in results)
    assert results[1]["p2p"] is True
    assert {r["env"] for r in results} == {"weights"}  # the link's env reached each member's process
    assert {r["epoch"] for r in results} == {0}


def big_bucket(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Large tensors travel from their own memory in pieces, small ones gathered into runs."""
    g = torch.Generator().manual_seed(seed)
    return [("big", torch.randn(5 << 20, generator=g)),           # 20 MiB: three pieces
            *make_bucket(seed),                                   # small ones, odd sizes: one run
            ("mid", torch.randn(3 << 18, generator=g).to(torch.bfloat16)),   # 1.5 MiB: one piece
            ("tail", torch.randn(11, generator=g).half())]


def test_a_bucket_travels_unpacked_arrives_as_packed_and_lands_in_recycled_buffers() -> None:
    port = free_port()

    def member(rank: int) -> dict:
        link = BulkLink(config("weights", port, rank, 2))
        link.open(epoch=0)
        if rank == 0:
            for seed in range(3):
                link.broadcast(big_bucket(seed), src=0)
            link.send_packed(pack_bucket(big_bucket(7), 9), dst=1)
            return {}
        first = link.broadcast(None, src=0)
        ok = same_bucket(first, big_bucket(0))
        where = first[0][1].data_ptr()
        del first   # the views go: the next bucket lands in the same buffer
        second = link.broadcast(None, src=0)
        reused = second[0][1].data_ptr() == where
        third = link.broadcast(None, src=0)   # `second` is still held: a buffer of its own
        ok = ok and same_bucket(second, big_bucket(1)) and same_bucket(third, big_bucket(2))
        p2p = link.recv(src=0)
        return {"ok": ok and same_bucket(p2p, big_bucket(7)), "reused": reused,
                "apart": third[0][1].data_ptr() != second[0][1].data_ptr()}

    _, got = run_procs([lambda r=r: member(r) for r in range(2)])
    assert got == {"ok": True, "reused": True, "apart": True}


def test_the_header_received_is_the_one_pack_bucket_writes() -> None:
    port = free_port()

    def member(rank: int) -> Any:
        link = BulkLink(config("weights", port, rank, 2))
        link.open(epoch=0)
        if rank == 0:
            link.broadcast(big_bucket(3), src=0)
            return None
        return link.broadcast_packed(None, src=0).header

    _, header = run_procs([lambda r=r: member(r) for r in range(2)])
    assert header == pack_bucket(big_bucket(3), 0).header   # names, offsets, sizes, checksum, in order
    assert list(header) == list(pack_bucket(big_bucket(3), 0).header)


def test_checksum_mismatch_is_detected_by_every_receiver() -> None:
    port = free_port()

    def member(rank: int) -> str:
        link = BulkLink(config("weights", port, rank, 3))
        link.open(epoch=0)
        if rank == 0:
            packed = pack_bucket(make_bucket(5), bucket_id=4)
            packed.flat[packed.header["tensors"][1]["offset"]] ^= 0x01  # one flipped bit after hashing
            link.broadcast_packed(packed, src=0)
            return "sent"
        try:
            unpack_bucket(link.broadcast_packed(None, src=0), link.config.name)
        except ChecksumMismatch as exc:
            return str(exc)
        return "accepted corrupted bucket"

    results = run_procs([lambda r=r: member(r) for r in range(3)])
    assert results[0] == "sent"
    for msg in results[1:]:
        assert msg.startswith("link 'weights': bucket 4 checksum mismatch"), msg


def test_reform_after_member_restart() -> None:
    """Rank 2 dies after epoch 0; a fresh rank-2 process joins epoch 1 with the survivors,
    who were told to re-form through a queue standing in for the control bus."""
    port = free_port()
    control = [CTX.Queue() for _ in range(2)]
    died = CTX.Event()  # an Event, not a Queue: os._exit would drop an unflushed queue item

    def survivor(rank: int) -> list[bool]:
        link = BulkLink(config("weights", port, rank, 3))
        link.open(0)
        ok = [same_bucket(link.broadcast(make_bucket(0) if rank == 0 else None, src=0), make_bucket(0))]
        epoch = control[rank].get(timeout=WAIT_S)  # "rank 2 restarted: re-form at epoch 1"
        link.reform(epoch)
        ok.append(same_bucket(link.broadcast(make_bucket(1) if rank == 0 else None, src=0), make_bucket(1)))
        ok.append(link.latest_epoch() == 1 if rank == 0 else True)
        return ok

    def doomed() -> None:
        link = BulkLink(config("weights", port, 2, 3))
        link.open(0)
        link.broadcast(None, src=0)
        died.set()
        os._exit(17)  # a crash: no cleanup, no goodbye

    def restarted() -> bool:
        link = BulkLink(config("weights", port, 2, 3))
        link.open(1)
        return same_bucket(link.broadcast(None, src=0), make_bucket(1))

    queue = CTX.Queue()

    def wrap(fn: Callable[[], Any], i: int) -> None:
        try:
            queue.put((i, fn()))
        except BaseException as exc:
            queue.put((i, f"ERR {type(exc).__name__}: {exc}"))

    procs = [CTX.Process(target=wrap, args=(lambda r=r: survivor(r), r)) for r in range(2)]
    victim = CTX.Process(target=doomed)
    for p in procs + [victim]:
        p.start()
    try:
        assert died.wait(timeout=WAIT_S)
        victim.join(timeout=WAIT_S)
        assert victim.exitcode == 17
        newcomer = CTX.Process(target=wrap, args=(restarted, 2))
        newcomer.start()
        procs.append(newcomer)
        for q in control:
            q.put(1)
        results = dict(queue.get(timeout=WAIT_S) for _ in range(3))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert results == {0: [True, True, True], 1: [True, True, True], 2: True}, results


def test_an_epoch_of_some_members_leaves_a_hung_one_out() -> None:
    """r1 hangs (it takes no part in epoch 0's broadcast). The master and r0 abandon that transfer, form
    epoch 1 of the two of them and move a bucket at once; their abandoned threads still end on their
    own group (an error naming epoch 0), never on the new one. When r1 is back, epoch 2 of all
    three moves the next bucket to everyone."""
    import threading

    port, members = free_port(), ["ps", "r0", "r1"]
    back = CTX.Event()

    def link_of(rank: int) -> BulkLink:
        return BulkLink(LinkConfig(name="weights", backend="gloo", master_addr="127.0.0.1", master_port=port,
                                   rank=rank, world_size=3, members=members, timeout_s=4))

    def abandoned(fn: Callable[[], Any]) -> tuple[threading.Thread, list[str]]:
        errors: list[str] = []

        def body() -> None:
            try:
                fn()
            except BulkError as exc:
                errors.append(str(exc))
        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        return thread, errors

    def healthy(rank: int) -> list[Any]:
        link = link_of(rank)
        link.open(0)
        big = [("w", torch.randn(4 << 20))]   # 16 MiB: more than the socket buffers take without a reader
        thread, errors = abandoned(lambda: link.broadcast(big if rank == 0 else None, src=0, epoch=0))
        link.reform(1, ["ps", "r0"])
        got1 = link.broadcast(make_bucket(1) if rank == 0 else None, src=0)
        rank_in_1 = link.rank
        back.wait(timeout=WAIT_S)
        link.reform(2)
        got2 = link.broadcast(make_bucket(2) if rank == 0 else None, src=0)
        thread.join(timeout=WAIT_S)
        return [same_bucket(got1, make_bucket(1)), rank_in_1, same_bucket(got2, make_bucket(2)), link.members,
                [e.split(":")[0] for e in errors]]

    def hung() -> list[Any]:
        link = link_of(2)
        link.open(0)
        back.set()   # "SIGCONT": it sat out epoch 0's broadcast and epoch 1 entirely
        link.reform(2)
        return [same_bucket(link.broadcast(None, src=0), make_bucket(2)), link.rank]

    ps, r0, r1 = run_procs([lambda: healthy(0), lambda: healthy(1), hung])
    assert ps[:4] == [True, 0, True, members] and r0[:4] == [True, 1, True, members]
    assert r1 == [True, 2]
    for errors in (ps[4], r0[4]):   # the abandoned transfer failed on epoch 0, if it did not finish
        assert all(e == "link 'weights' epoch 0" for e in errors), errors


def test_a_subset_must_be_configured_members_with_the_master_first() -> None:
    link = BulkLink(LinkConfig(name="w", backend="gloo", master_addr="127.0.0.1", master_port=1, rank=1,
                               world_size=3, members=["ps", "r0", "r1"]))
    for members, why in ((["r0", "ps"], "must come first"), (["ps", "r1"], "is not among"),
                         (["ps", "r0", "r9"], "not distinct configured")):
        with pytest.raises(BulkError, match=why):
            link.open(0, members)


def test_two_links_in_one_process_relay() -> None:
    """The parameter server's shape: it receives from the trainer on one link and broadcasts to two
    rollouts on another, both in the same process."""
    train_port, roll_port = free_port(), free_port()

    def trainer() -> str:
        link = BulkLink(config("train_ps", train_port, 0, 2))
        link.open(0)
        link.send(make_bucket(42), dst=1)
        return "sent"

    def param_server() -> bool:
        up = BulkLink(config("train_ps", train_port, 1, 2))
        down = BulkLink(config("ps_rollout", roll_port, 0, 3))
        up.open(0)
        down.open(0)
        bucket = up.recv(src=0)
        down.broadcast(bucket, src=0)
        return same_bucket(bucket, make_bucket(42))

    def rollout(rank: int) -> bool:
        link = BulkLink(config("ps_rollout", roll_port, rank, 3))
        link.open(0)
        return same_bucket(link.broadcast(None, src=0), make_bucket(42))

    assert run_procs([trainer, param_server, lambda: rollout(1), lambda: rollout(2)]) == ["sent", True, True, True]


def test_rendezvous_timeout_names_the_link() -> None:
    link = BulkLink(LinkConfig(name="lonely", backend="gloo", master_addr="127.0.0.1", master_port=free_port(),
                               rank=0, world_size=2, timeout_s=1))
    with pytest.raises(LinkRendezvousError, match=r"link 'lonely' epoch 0: rank 0/2 could not form"):
        link.open(0)
    link.close()   # no store server thread left running in this process: a later test forks it


def test_the_bulk_benchmark_measures_every_mode_against_raw() -> None:
    from tools.bench.bulk import MODES, measure

    out = measure(mib=1, reps=2, timeout_s=WAIT_S)
    assert "error" not in out, out
    assert all(out[f"{m}_gb_per_s"] > 0 for m in MODES)
    assert all(out[f"{m}_ratio"] > 0 for m in MODES[1:])


def test_the_rendezvous_store_listens_on_the_links_master_address_only() -> None:
    # A TCPStore's server listens on every interface: a one-node run's rendezvous was open to the network.
    import datetime
    import socket

    from transport.bulk import rendezvous_server

    def reachable(port: int) -> list[bool]:
        out = []
        for addr in ("127.0.0.1", "127.0.0.2"):        # another address of this machine (all of 127/8 is loopback)
            try:
                socket.create_connection((addr, port), timeout=5).close()
                out.append(True)
            except ConnectionRefusedError:
                out.append(False)
        return out

    port = free_port()
    server = rendezvous_server("127.0.0.1", port, 2, datetime.timedelta(seconds=5))
    assert reachable(port) == [True, False]
    del server

    def lonely_master() -> list[bool]:                   # the link's own store goes the same way
        link = BulkLink(LinkConfig(name="lonely", backend="gloo", master_addr="127.0.0.1", master_port=port,
                                   rank=0, world_size=2, timeout_s=1))
        with pytest.raises(LinkRendezvousError):
            link.open(0)
        return reachable(port)

    assert run_procs([lonely_master]) == [[True, False]]


def test_rendezvous_values_not_signed_with_the_runs_secret_fail_the_formation(tmp_path: Any) -> None:
    # torch's TCPStore has no authentication: another user read and wrote a run's rendezvous keys. Values are
    # signed with a per-run secret now, so a forged one (here: rank 1's gloo address) stops the formation.
    import datetime

    import torch.distributed as dist

    from transport.bulk import RendezvousForgery, SignedStore, generate_rendezvous_secret, rendezvous_server

    secret_file = generate_rendezvous_secret(tmp_path)
    assert oct(os.stat(secret_file).st_mode & 0o777) == "0o600"
    port = free_port()

    def master() -> str:
        link = BulkLink(LinkConfig(name="weights", backend="gloo", master_addr="127.0.0.1", master_port=port, rank=0,
                                   world_size=2, timeout_s=20, secret_file=secret_file))
        with pytest.raises(BulkError) as failed:
            link.open(0)
        return str(failed.value)

    def intruder() -> bool:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=20),
                              wait_for_workers=False)
        store.wait(["weights/epoch0/0/0"])             # the master's own address is there: it waits for rank 1's
        readable = len(store.get("weights/epoch0/0/0")) > 32      # readable, but signed
        store.set("weights/epoch0/0/1", b"an address of the intruder's choosing")
        return readable

    error, readable = run_procs([master, intruder])
    assert readable
    assert "rendezvous key 'weights/epoch0/0/1' was not written by a member of this run" in error

    def signed_round_trip(port: int) -> list[bytes | str]:
        server = rendezvous_server("127.0.0.1", port, 1, datetime.timedelta(seconds=5))
        signed = SignedStore(dist.TCPStore("127.0.0.1", port, 1, timeout=datetime.timedelta(seconds=5),
                                           wait_for_workers=False), b"s" * 32)
        signed.set("k", "v")
        try:
            SignedStore(signed.inner, b"t" * 32).get("k")   # another run's secret
            other = "read"
        except RendezvousForgery:
            other = "refused"
        got = [signed.get("k"), other]
        del server
        return got

    assert run_procs([lambda: signed_round_trip(free_port())]) == [[b"v", "refused"]]


def test_a_link_with_the_runs_secret_forms_and_moves_buckets(tmp_path: Any) -> None:
    from transport.bulk import generate_rendezvous_secret

    secret_file, port = generate_rendezvous_secret(tmp_path), free_port()

    def member(rank: int) -> bool:
        link = BulkLink(LinkConfig(name="weights", backend="gloo", master_addr="127.0.0.1", master_port=port,
                                   rank=rank, world_size=2, timeout_s=30, secret_file=secret_file))
        link.open(epoch=0)
        got = link.broadcast(make_bucket(5) if rank == 0 else None, src=0)
        link.reform(1)
        again = link.broadcast(make_bucket(6) if rank == 0 else None, src=0)
        latest = link.latest_epoch()     # read through the signed store too
        link.barrier()                   # the master's store outlives every member's read
        return same_bucket(got, make_bucket(5)) and same_bucket(again, make_bucket(6)) and latest == 1

    assert run_procs([lambda r=r: member(r) for r in range(2)]) == [True, True]
