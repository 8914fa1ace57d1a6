"""The limits an entry's manifest keeps to: what its reader
(``_entry.unpack_manifest``) accepts, so what every writer keeps to as well
(``_entry.pack_manifest`` reads each manifest back before it is written, and
``_blocks.plan_bounds`` never cuts an entry into more blocks than a list holds).
"""

MAX_MANIFEST = 64 * 1024 * 1024  # bytes of one manifest
MAX_TOKENS = 1 << 24  # token ids of one entry (their bytes: the reader's max_bin_len)
MAX_LAYERS = 4096
MAX_ARRAYS = 1 << 16  # items of one list (array records, block bounds, a shared array's parts): the reader's max_array_len
MAX_MAP = 1 << 16  # items of one map: the reader's max_map_len
MAX_STR = 1 << 20  # UTF-8 bytes of one string (the model identity, a meta string): the reader's max_str_len
MAX_PAYLOAD = 1 << 40  # bytes of an entry's own payload
