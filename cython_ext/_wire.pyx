# cython: boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True, nonecheck=False
"""Compiled frame decoder (wanlink._wire).

``FrameDecoder`` has the methods, events and errors of the pure-Python reference,
``wanlink.proto.frames.FrameDecoder`` (see that class and ``wanlink.proto.decoder``): it decodes
headers in C, straight from the read-ahead area when a whole one lies there, and builds only the
Python objects a frame's consumer sees (its ``Header`` and event). A header that fails any check
is handed to the reference's ``parse_header``, so a malformed frame raises exactly the reference's
error. ``receive`` is the stream reader's loop of scatter reads (``readv``, without the GIL).
"""
from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

import zlib

from wanlink.errors import LocalProtocolError
from wanlink.proto import frames as _frames

cdef extern from "<errno.h>":
    int EWOULDBLOCK

cdef extern from "sys/uio.h" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len
    ssize_t readv(int fd, const iovec* iov, int iovcnt)

WIRE_ABI = 1
"""Bumped whenever this module's interface to wanlink.proto.decoder changes (a stale build is not used)."""

cdef enum:
    HEADER_SIZE = 44
    T_DATA = 1
    T_ACK = 2
    T_CONTROL = 3
    T_PING = 4
    T_CLOSE = 5
    T_GRANT = 6
    T_CREDIT = 7
    T_ANNOUNCE = 8
    T_ABORT = 9
    F_LZ4 = 1
    F_CHECKSUM = 2
    KNOWN_FLAGS = 7

# what the reference module defines, held in C variables (looked up once, here)
cdef object _Header, _parse_header, _decompress_into, _RemoteProtocolError
cdef object _ChunkReceived, _AckReceived, _FlowReceived, _ControlReceived, _AbortReceived, _PingReceived, _CloseReceived
(_Header, _parse_header, _decompress_into, _RemoteProtocolError, _ChunkReceived, _AckReceived, _FlowReceived,
 _ControlReceived, _AbortReceived, _PingReceived, _CloseReceived) = [getattr(_frames, name) for name in (
    "Header", "parse_header", "_decompress_into", "RemoteProtocolError", "ChunkReceived", "AckReceived",
    "FlowReceived", "ControlReceived", "AbortReceived", "PingReceived", "CloseReceived")]
cdef object _tuple_new = tuple.__new__
cdef object _crc32 = zlib.crc32
cdef list _TYPES = [None] + [_frames.FrameType(t) for t in range(1, 10)]
cdef Py_ssize_t READ_AHEAD = _frames.READ_AHEAD_BYTES
cdef Py_ssize_t BULK_READ_AHEAD = _frames.BULK_READ_AHEAD_BYTES
assert HEADER_SIZE == _frames.HEADER_SIZE and len(_frames.FrameType) == 9


cdef inline uint32_t _u32(const uint8_t* p) noexcept nogil:
    return <uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline uint64_t _u64(const uint8_t* p) noexcept nogil:
    return <uint64_t>_u32(p) | (<uint64_t>_u32(p + 4) << 32)


cdef class FrameDecoder:
    """See ``wanlink.proto.frames.FrameDecoder``: the same interface and results."""

    cdef object _place
    cdef object _limits
    cdef uint64_t _max_transfer, _max_frame, _max_control
    cdef bytearray _header_buf
    cdef object _header_view
    cdef object _target  # the memoryview the next bytes go to (header, payload destination, compressed)
    cdef Py_buffer _tbuf  # _target's buffer, held while it is the target
    cdef bint _tbuf_held
    cdef uint8_t* _tptr
    cdef Py_ssize_t _tlen
    cdef Py_ssize_t _filled
    cdef object _header  # Header of the frame whose payload is arriving, else None
    cdef object _compressed
    cdef object _destination
    cdef bytearray _ahead_buf
    cdef object _ahead_full, _ahead_bulk  # views of _ahead_buf: the whole, and BULK_READ_AHEAD bytes
    cdef Py_ssize_t _ahead_len  # the read-ahead offered now (see the reference's BULK_READ_AHEAD_BYTES)
    cdef uint8_t* _aptr

    def __cinit__(self):
        self._tbuf_held = False

    def __init__(self, place, limits=_frames.DEFAULT_LIMITS):
        self._place = place
        self._limits = limits
        self._max_transfer = limits.max_transfer_size
        self._max_frame = limits.max_frame_payload
        self._max_control = limits.max_control_size
        self._header_buf = bytearray(HEADER_SIZE)
        self._header_view = memoryview(self._header_buf)
        self._ahead_buf = bytearray(READ_AHEAD)
        self._ahead_full = memoryview(self._ahead_buf)
        self._ahead_bulk = self._ahead_full[:BULK_READ_AHEAD]
        self._ahead_len = READ_AHEAD
        self._aptr = <uint8_t*><char*>self._ahead_buf
        self._header = None
        self._compressed = None
        self._destination = None
        self._set_target(self._header_view)

    def __dealloc__(self):
        if self._tbuf_held:
            PyBuffer_Release(&self._tbuf)

    cdef int _set_target(self, object view) except -1:
        if self._tbuf_held:
            PyBuffer_Release(&self._tbuf)
            self._tbuf_held = False
        self._target = view
        PyObject_GetBuffer(view, &self._tbuf, PyBUF_WRITABLE)
        self._tbuf_held = True
        self._tptr = <uint8_t*>self._tbuf.buf
        self._tlen = self._tbuf.len
        self._filled = 0
        return 0

    def buffer(self):
        """The writable region the next received bytes must be written to."""
        return self._target[self._filled:]

    def buffers(self):
        """``buffer()`` and then the read-ahead area, for one scatter read."""
        return [self._target[self._filled:], self._ahead_full if self._ahead_len == READ_AHEAD else self._ahead_bulk]

    def advance(self, Py_ssize_t nbytes):
        """Account for ``nbytes`` just written into ``buffers()``; returns completed events."""
        cdef list events = []
        self._advance(nbytes, events)
        return events

    cdef int _advance(self, Py_ssize_t nbytes, list events) except -1:
        cdef Py_ssize_t offered = self._tlen - self._filled
        if nbytes < 0 or nbytes > offered + self._ahead_len:
            raise LocalProtocolError(f"advance({nbytes}) beyond the {offered} bytes offered "
                                     f"(and {self._ahead_len} of read-ahead)")
        if nbytes <= offered:
            self._step(nbytes, events)
            return 0
        self._step(offered, events)
        self._consume(self._aptr, nbytes - offered, events)
        return 0

    cdef int _consume(self, const uint8_t* data, Py_ssize_t size, list events) except -1:
        """Decode ``size`` bytes at ``data`` (not the target): whole headers in place, the rest copied."""
        cdef Py_ssize_t start = 0, take
        while start < size:
            if self._header is None and self._filled == 0 and size - start >= HEADER_SIZE:
                start += HEADER_SIZE
                self._on_header(data + start - HEADER_SIZE, events)
                continue
            take = min(self._tlen - self._filled, size - start)
            memcpy(self._tptr + self._filled, data + start, take)
            start += take
            self._step(take, events)
        return 0

    cdef int _step(self, Py_ssize_t nbytes, list events) except -1:
        self._filled += nbytes
        if self._filled < self._tlen:
            return 0
        if self._header is None:
            self._on_header(self._tptr, events)
        else:
            events.append(self._on_payload_complete())
        return 0

    cdef int _on_header(self, const uint8_t* p, list events) except -1:
        cdef uint8_t ftype = p[0], flags = p[1]
        cdef int64_t tag = <int64_t>_u64(p + 4)
        cdef uint32_t seq = _u32(p + 12)
        cdef uint64_t total = _u64(p + 16), offset = _u64(p + 24)
        cdef uint32_t wire_len = _u32(p + 32), raw_len = _u32(p + 36), checksum = _u32(p + 40)
        cdef bint valid = 1 <= ftype <= 9 and p[2] == 0 and p[3] == 0 and not (flags & ~KNOWN_FLAGS)
        if valid:
            if ftype == T_DATA:
                valid = (total <= self._max_transfer and raw_len <= self._max_frame and wire_len <= self._max_frame
                         and offset <= total and raw_len <= total - offset
                         and ((flags & F_LZ4) or wire_len == raw_len) and ((flags & F_CHECKSUM) or checksum == 0))
            else:
                valid = flags == 0
                if valid and ftype == T_ANNOUNCE:
                    valid = total <= self._max_transfer
                if valid and ftype != T_CONTROL and ftype != T_ABORT:
                    valid = wire_len == 0
                if valid and (ftype == T_CONTROL or ftype == T_ABORT):
                    valid = wire_len <= self._max_control
                if valid and ftype == T_ACK:
                    valid = offset <= total and raw_len <= total - offset
        if not valid:  # the reference says what is wrong, in its words
            _parse_header(bytes((<const char*>p)[:HEADER_SIZE]), self._limits)
            raise AssertionError("the compiled decoder refused a header the reference accepts")
        header = _tuple_new(_Header, (_TYPES[ftype], flags, tag, seq, total, offset, wire_len, raw_len, checksum))
        if ftype == T_ACK:
            events.append(_AckReceived(header))
        elif ftype == T_GRANT or ftype == T_CREDIT or ftype == T_ANNOUNCE:
            events.append(_FlowReceived(header))
        elif ftype == T_PING:
            events.append(_PingReceived())
        elif ftype == T_CLOSE:
            events.append(_CloseReceived())
        else:
            self._start_payload(header, ftype, flags, wire_len, raw_len, events)
            return 0
        if self._filled:  # (a header decoded in place leaves the header target empty)
            self._filled = 0
        return 0

    cdef int _start_payload(self, header, uint8_t ftype, uint8_t flags, uint32_t wire_len, uint32_t raw_len,
                            list events) except -1:
        self._header = header
        if ftype != T_DATA or flags & F_LZ4:
            self._compressed = bytearray(wire_len)
            self._set_target(memoryview(self._compressed))
        if ftype == T_DATA:
            destination = self._place(header)
            if len(destination) != raw_len:
                raise LocalProtocolError("payload placer returned a view of the wrong size")
            if flags & F_LZ4:
                self._destination = destination
            else:
                self._set_target(destination)
        self._filled = 0
        if wire_len == 0:
            events.append(self._on_payload_complete())
        return 0

    cdef object _on_payload_complete(self):
        header = self._header
        cdef uint8_t ftype = header[0]
        cdef uint8_t flags = header[1]
        if ftype == T_CONTROL:
            event = _ControlReceived(bytes(self._compressed))
        elif ftype == T_ABORT:
            event = _AbortReceived(bytes(self._compressed))
        else:
            if flags & F_LZ4:
                _decompress_into(self._compressed, self._destination, header)
                raw = self._destination
            else:
                raw = self._target
            if flags & F_CHECKSUM and _crc32(raw) != header.checksum:
                raise _RemoteProtocolError(f"checksum mismatch in chunk at offset {header.offset} "
                                           f"of tag={header.tag} seq={header.seq}")
            event = _ChunkReceived(header)
        self._ahead_len = BULK_READ_AHEAD if <uint32_t>header[6] > READ_AHEAD else READ_AHEAD  # (wire_len)
        self._header = None
        self._compressed = None
        self._destination = None
        self._set_target(self._header_view)
        return event

    def landing(self):
        """(tag, seq, offset) of the DATA chunk whose payload is being received now, else None."""
        header = self._header
        if header is None or header[0] != T_DATA:
            return None
        return header.tag, header.seq, header.offset

    def redirect(self, destination):
        """The chunk being received goes to ``destination`` from now on (see the reference)."""
        header = self._header
        if header is None or header[0] != T_DATA or len(destination) != header.raw_len:
            raise LocalProtocolError("redirect() needs a DATA payload in progress and a view of its size")
        if header.flags & F_LZ4:
            self._destination = destination
            return
        cdef Py_ssize_t filled = self._filled
        destination[:filled] = self._target[:filled]
        self._set_target(destination)
        self._filled = filled

    def feed(self, data):
        """Decode ``data`` (any bytes-like object), as buffer()/advance() would; returns the events."""
        cdef const uint8_t[::1] view = memoryview(data).cast("B")
        cdef list events = []
        cdef Py_ssize_t start = 0, size = view.shape[0], take
        while start < size:
            take = min(self._tlen - self._filled, size - start)
            memcpy(self._tptr + self._filled, &view[start], take)
            start += take
            self._step(take, events)
        return events

    def receive(self, int fd, Py_ssize_t budget):
        """Scatter-read ``fd`` (non-blocking) into ``buffers()`` and decode, until a read comes back
        short or ``budget`` bytes were read: ``wanlink.io.stream.receive_into`` in C, the reads
        without the GIL. Returns (bytes read, events, whether the peer closed its side); a read error
        raises OSError unless bytes were read before it."""
        cdef list events = []
        cdef Py_ssize_t total = 0, offered, asked
        cdef ssize_t n
        cdef iovec iov[2]
        while total < budget:
            offered = self._tlen - self._filled
            iov[0].iov_base = self._tptr + self._filled
            iov[0].iov_len = offered
            iov[1].iov_base = self._aptr
            iov[1].iov_len = self._ahead_len
            asked = offered + self._ahead_len
            with nogil:
                n = readv(fd, iov, 2)
            if n < 0:
                if errno == EINTR:
                    continue
                if errno == EAGAIN or errno == EWOULDBLOCK:
                    break
                if total:  # what arrived before the error still counts; the next read meets it again
                    break
                raise OSError(errno, _strerror(errno))
            if n == 0:
                return total, events, True
            total += n
            self._advance(n, events)
            if n < asked:
                break
        return total, events, False


cdef object _strerror(int code):
    import os
    return os.strerror(code)
