"""Mechanism only: the one layer of kvstream that touches the kernel.

``files`` holds small plain functions (open, create, publish, drop pages); ``ops`` the unit of
I/O; ``uring`` and ``threads`` two interchangeable :class:`~kvstream_backend.io.ops.IoQueue`
implementations that complete ops into a shared :class:`~kvstream_backend.io.ops.Waker`;
``probe`` decides per directory which of them (and whether O_DIRECT) works.
"""
