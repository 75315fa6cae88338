"""glibc malloc settings for the encoder replicas, set in their runtime_env before the process starts
(glibc reads them once, at its first allocation).

The cause they answer (measured: docs/benchmark-log.md, runs S3 and S4). An encoder replica's
preprocessing threads decode images and audio into buffers of 0.1-30 MiB and free them. glibc serves
a block over its mmap threshold (128 KiB at start) with its own ``mmap``, and on freeing one raises the
threshold to that block's size ("dynamic threshold", up to 32 MiB). From then on such buffers come from
the arenas: the main heap and up to 8 per core, one per thread that finds the others locked. Freed in
the middle of an arena, between live small objects, their pages stay resident: each arena keeps the
high-water mark of what its threads ever held, fragmented. The soak saw each encoder's RSS grow by
0.7-1.4 GiB over its first ~9 minutes, the arena heaps 18 -> 28 and the main heap 25 -> 750 MiB.

What answers it: ``MALLOC_ARENA_MAX`` caps the arenas at 2, so pools are not copied per thread, and
the encoder replica's heap trimmer (encoder_service/heap_trim.py) hands every arena's free pages back
to the kernel once a second (``malloc_trim``). A fixed ``MALLOC_MMAP_THRESHOLD_`` of 128 KiB (every
large buffer its own mapping) held RSS flat too, but cost ~55 % more CPU per image (a fresh mapping and
its page faults per buffer: 23-24 -> 37-41 CPU-ms per image, run AW), so it is not set.
"""

from __future__ import annotations

ENCODER_MALLOC_ENV = {"MALLOC_ARENA_MAX": "2"}
