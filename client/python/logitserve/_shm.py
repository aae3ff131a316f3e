"""Shared-memory inputs for workers on the server's host (no tensor bytes on the wire).

    with logitserve.SharedMemoryRegion(client, 64 << 20) as region:
        h = region.put(hidden_bf16_bits)           # copies once into shared memory
        ids = region.put(target_ids, offset=h.end)
        client.score(head="policy", hidden=h, target_ids=ids, entropy=True)

or write in place: `a = region.ndarray((n, H), np.uint16)` then fill `a` and pass
`region.tensor(0, (n, H), "bf16")`. Do not rewrite bytes a request is reading until its result
came back; close() (unregister) returns only once the server reads the region no more.
"""

import os

import numpy as np

from . import _pb

_ALIGN = 64  # put() places tensors on cache-line boundaries
_WIRE = {"bf16": "BFLOAT16", "bfloat16": "BFLOAT16", "fp16": "FLOAT16", "float16": "FLOAT16",
         "fp32": "FLOAT32", "float32": "FLOAT32", "int32": "INT32", "int64": "INT64"}
_SIZE = {"BFLOAT16": 2, "FLOAT16": 2, "FLOAT32": 4, "INT32": 4, "INT64": 8}


class SharedTensor:
    """A tensor the server reads from a registered region: `region` (its registered name),
    byte `offset`, wire dtype name ("BFLOAT16", "FLOAT16", "FLOAT32", "INT32", "INT64": the
    logitserve.v1.DataType values without their DATA_TYPE_ prefix) and
    `shape`. Pass it to score() wherever an array is accepted.

    The serialized Tensor message is kept from one request to the next (`tensor_wire`) and
    rebuilt once region, offset, dtype or shape is assigned another value."""

    __slots__ = ("region", "offset", "dtype", "shape", "_wire")

    def __init__(self, region, offset, dtype, shape):
        self.region = region
        self.offset = int(offset)
        name = str(dtype).upper()
        if name.startswith("DATA_TYPE_"):  # the proto enum's value names are accepted too
            name = name[len("DATA_TYPE_"):]
        self.dtype = _WIRE.get(name.lower(), name)
        if self.dtype not in _SIZE:
            raise ValueError("SharedTensor: unknown dtype %r" % (dtype,))
        self.shape = tuple(int(d) for d in shape)
        self._wire = None  # see tensor_wire

    @property
    def nbytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * _SIZE[self.dtype]

    @property
    def end(self):
        """First byte after the tensor (where the next one may go)."""
        return self.offset + self.nbytes

    def tensor_message(self):
        pb2 = _pb.pb2()
        return pb2.Tensor(dtype=getattr(pb2, "DATA_TYPE_" + self.dtype), shape=list(self.shape),
                          shared_memory=pb2.SharedMemoryRef(region=self.region, offset=self.offset,
                                                            byte_size=self.nbytes))

    def tensor_wire(self):
        """(the serialized tensor_message(), its shape as a tuple): built on the first request,
        then reused while region, offset, dtype and shape are the very objects it was built
        from (a cache only for attributes of immutable exact types: str, int, a tuple of int)."""
        c = self._wire
        if (c is None or c[0] is not self.region or c[1] is not self.offset
                or c[2] is not self.dtype or c[3] is not self.shape):
            msg = self.tensor_message()
            c = (self.region, self.offset, self.dtype, self.shape, msg.SerializeToString(),
                 tuple(msg.shape))
            if (type(self.region) is str and type(self.offset) is int and type(self.dtype) is str
                    and type(self.shape) is tuple and all(type(d) is int for d in self.shape)):
                self._wire = c
        return c[4], c[5]

    def __repr__(self):
        return "SharedTensor(%r, offset=%d, %s%s)" % (self.region, self.offset, self.dtype,
                                                      list(self.shape))


class SharedMemoryRegion:
    """A POSIX shared-memory object this process creates (multiprocessing.shared_memory), maps
    read-write and registers with the server (RegisterSharedMemory) under `name` (default: the
    object's own name). `client` is a logitserve.Client on the same host. The object is created
    with mode 0600 (`mode` changes it: the server's user must be able to read it). close() unregisters
    (waiting for requests that read it), then unmaps and unlinks the object."""

    def __init__(self, client, size, name=None, mode=None, _register=True):
        from multiprocessing import shared_memory
        self._client = client
        self._shm = shared_memory.SharedMemory(create=True, size=int(size))
        if mode is not None:  # e.g. 0o640 for a server running as another user of the group
            os.fchmod(self._shm._fd, mode)
        self.key = "/" + self._shm.name.lstrip("/")
        self.name = name or self._shm.name.lstrip("/")
        self.size = int(size)
        self._closed = False
        if _register:
            try:
                client.register_shared_memory(self.name, self.key, 0, self.size)
            except BaseException:
                self._release()
                raise

    @classmethod
    async def create(cls, client, size, name=None, mode=None):
        """The same for a logitserve.AsyncClient: `region = await SharedMemoryRegion.create(...)`,
        and `await region.aclose()` (or `async with`)."""
        region = cls(client, size, name, mode, _register=False)
        try:
            await client.register_shared_memory(region.name, region.key, 0, region.size)
        except BaseException:
            region._release()
            raise
        return region

    def _release(self):
        self._closed = True
        try:
            self._shm.close()
        except BufferError:  # ndarray() views still alive: unmapped when they are collected
            pass
        self._shm.unlink()

    @property
    def buf(self):
        """The region's bytes (a writable memoryview)."""
        return self._shm.buf

    def ndarray(self, shape, dtype, offset=0):
        """A numpy array of `dtype` viewing the region's bytes at `offset` (write it in place)."""
        return np.ndarray(shape, dtype=dtype, buffer=self._shm.buf, offset=offset)

    def tensor(self, offset, shape, dtype):
        """A SharedTensor naming bytes the caller placed at `offset` (dtype as in score:
        "bf16", "fp16", "fp32", "int32", "int64")."""
        t = SharedTensor(self.name, offset, dtype, shape)
        if offset < 0 or t.end > self.size:
            raise ValueError("SharedMemoryRegion: [%d, %d) is outside the region's %d bytes" %
                             (offset, t.end, self.size))
        return t

    def put(self, array, offset=0, dtype=None):
        """Copies `array` into the region at `offset` (rounded up to 64 bytes) in wire form (float
        arrays as score()'s `dtype` rules; integer arrays as token ids) and returns its
        SharedTensor."""
        from ._tensors import as_array, float_array, id_array
        a = as_array(array, "array")
        wire, data = id_array(a, "array") if a.dtype.kind in "iu" and a.dtype != np.uint16 \
            else float_array(a, dtype, "array")
        offset = -(-int(offset) // _ALIGN) * _ALIGN
        t = self.tensor(offset, data.shape, wire)
        self.ndarray(data.shape, data.dtype, offset)[...] = data
        return t

    def close(self):
        if self._closed:
            return
        try:
            self._client.unregister_shared_memory(self.name)
        finally:
            self._release()

    async def aclose(self):
        """close() for a region of an AsyncClient."""
        if self._closed:
            return
        try:
            await self._client.unregister_shared_memory(self.name)
        finally:
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
