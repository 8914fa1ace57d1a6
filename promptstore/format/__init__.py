"""The entry format: what an entry is on disk and how it is read back.

* ``_entry``: the manifest (msgpack) and the payload layout, checksums, the
  read strategies (LMDB chunks through the map or ``pread``) and decoding;
* ``_blobs``: the payload of a large entry in a file of its own;
* ``_fill``, ``_pages``, ``_blank``: the Linux fast path (parallel ``pread``
  into fresh mlx buffers, page residency, shared destination buffers);
* ``_bits``: bitwise comparison of arrays, for tests and the bench.
"""
