"""io_uring queue (the ``liburing`` package): one ring per tier and direction.

Reads land directly in the caller's buffers; short transfers are resubmitted for the rest.
The ring's eventfd is the tier's :class:`Waker`, so one poll covers both of a tier's rings.

Every SQE carries ``IOSQE_ASYNC``: without it the kernel first tries to issue an O_DIRECT read
inline, in ``io_uring_submit``, and on ext4 or FUSE that inline attempt does the whole transfer
(measured: 41-46 of 64-88 ms on ext4, 111 of 123 ms on GlusterFS for 4 x 16 MiB), so the
submitting thread stalls and a tier's reads run one after another. With the flag, submit
returns in microseconds and io-wq workers issue the reads in parallel; the total is the same.
"""

from __future__ import annotations

import liburing as L

from .memory import exporter
from .ops import IoOp, Waker


class UringQueue:
    kind = "uring"
    hashes_reads = False  # the kernel's workers move the bytes: no thread of ours sees them hot

    def __init__(self, depth: int, waker: Waker, async_issue: bool = True) -> None:
        self._ring = L.Ring()
        L.io_uring_queue_init(max(2, depth), self._ring)
        L.io_uring_register_eventfd(self._ring, waker.fd)
        self._cqe = L.Cqe()
        self._depth = depth
        self._flags = L.IOSQE_ASYNC if async_issue else 0
        self._ops: dict[int, tuple[IoOp, object]] = {}  # user_data -> (op, Iovec kept alive)
        self._next_id = 1
        self._backlog: list[IoOp] = []  # resubmissions that found no free SQE
        self._unsubmitted = 0
        self.inflight = 0

    def submit(self, op: IoOp) -> bool:
        if self.inflight >= self._depth:
            return False
        if not self._prep(op):
            return False
        self.inflight += 1
        return True

    def _prep(self, op: IoOp) -> bool:
        sqe = L.io_uring_get_sqe(self._ring)
        if sqe is None:
            return False
        segs, offset = op.remaining()
        iov = L.Iovec([exporter(s) for s in segs])
        if op.write:
            L.io_uring_prep_writev(sqe, op.fd, iov, offset)
        else:
            L.io_uring_prep_readv(sqe, op.fd, iov, offset)
        if self._flags:
            L.io_uring_sqe_set_flags(sqe, self._flags)
        uid = self._next_id
        self._next_id += 1
        sqe.user_data = uid
        self._ops[uid] = (op, iov)
        self._unsubmitted += 1
        return True

    def flush(self) -> None:
        while self._backlog and self._prep(self._backlog[0]):
            self._backlog.pop(0)
        if self._unsubmitted:
            L.io_uring_submit(self._ring)
            self._unsubmitted = 0

    def reap(self) -> list[IoOp]:
        done: list[IoOp] = []
        n = L.io_uring_cq_ready(self._ring)
        for _ in range(n):
            L.io_uring_peek_cqe(self._ring, self._cqe)
            entry = self._cqe[0]
            uid = entry.user_data
            try:
                res = entry.res
            except OSError as e:  # the binding raises on negative results
                res = -(e.errno or 5)
            L.io_uring_cqe_seen(self._ring, entry)
            op, _iov = self._ops.pop(uid)
            if res < 0:
                op.result = res
            else:
                op.done += res
                if res > 0 and op.done < op.length:  # short transfer: go on with the rest
                    if not self._prep(op):
                        self._backlog.append(op)
                    continue
                op.result = op.done
            self.inflight -= 1
            done.append(op)
        if n and (self._backlog or self._unsubmitted):
            self.flush()
        return done

    def close(self) -> None:
        L.io_uring_queue_exit(self._ring)
