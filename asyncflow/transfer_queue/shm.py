"""Memory of the storage units: an arena per unit and the allocator the controller runs over it.

Each storage unit owns one arena, a sparse file in /dev/shm (or anonymous memory when shared memory
is off). Clients on the same host map the arena once and copy tensors straight in and out of it, so a
same-host put or get costs one memcpy and two small control messages; clients elsewhere send the same
bytes over ZMQ and the unit copies them. Pages are touched only when written, so a large capacity
costs no RAM until used, and freed ranges are reused while their pages are still mapped (no new page
faults on the hot path).

The controller, not the unit, allocates ranges of the arena: it already decides where each row goes,
so a put needs no extra round trip to the unit to ask for space.
"""

from __future__ import annotations

import bisect
import mmap
import os
import re
import secrets

SHM_DIR = "/dev/shm"
ALIGN = 64  # cache-line alignment keeps vectorised copies fast


_ARENA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def valid_arena_name(name) -> bool:
    """A plain file name inside SHM_DIR: no separators, no leading dot (so no "..")."""
    return isinstance(name, str) and _ARENA_NAME.fullmatch(name) is not None


def new_shm_prefix() -> str:
    """A random name prefix for one deployment; its leftovers can be removed by prefix."""
    return f"afq-{os.getpid()}-{secrets.token_hex(4)}"


class Arena:
    """A contiguous byte region shared between a storage unit and same-host clients."""

    def __init__(self, size: int, mm: mmap.mmap, name: str | None, owner: bool):
        self.size = size
        self.name = name
        self._mm = mm
        self._owner = owner
        self.view = memoryview(mm)

    @classmethod
    def create(cls, size: int, name: str | None) -> Arena:
        """Create an arena; ``name`` None gives private anonymous memory (no same-host sharing)."""
        if name is None:
            return cls(size, mmap.mmap(-1, size), None, True)
        # O_EXCL: never adopt a file someone else prepared; 0600: only this user can map it.
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(size, mm, name, True)

    @classmethod
    def attach(cls, name: str, size: int) -> Arena:
        """Map an existing arena of a storage unit on this host (a plain name, never a symlink)."""
        if not valid_arena_name(name):
            raise ValueError(f"invalid arena name {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size != size:
                raise OSError(f"shared memory {name} has size {os.fstat(fd).st_size}, expected {size}")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(size, mm, name, False)

    def close(self) -> None:
        """Unmap; the owner also removes the name so that the memory goes back to the system."""
        self.view.release()
        try:
            self._mm.close()
        except BufferError:
            # A tensor still views the mapping; it is unmapped when that tensor dies.
            pass
        if self._owner and self.name:
            unlink_quietly(self.name)


def unlink_quietly(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def _shm_names() -> list[str]:
    try:
        return os.listdir(SHM_DIR)
    except FileNotFoundError:  # no /dev/shm on this system: nothing to clean
        return []


def remove_leftovers(prefix: str) -> int:
    """Remove shared-memory files of a deployment whose processes died without cleaning up."""
    removed = 0
    for name in _shm_names():
        if name.startswith(prefix):
            unlink_quietly(name)
            removed += 1
    return removed


def remove_stale() -> int:
    """Remove this user's arenas left by deployments whose creating process is gone (a SIGKILLed run
    cannot clean up; tmpfs pages it wrote would stay in RAM). Arenas of live processes are kept."""
    removed = 0
    for name in _shm_names():
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "afq" or not parts[1].isdigit():
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, name)).st_uid != os.getuid():
                continue
            os.kill(int(parts[1]), 0)  # the creator is alive (or the pid was reused): keep it
        except ProcessLookupError:
            unlink_quietly(name)
            removed += 1
        except (FileNotFoundError, PermissionError):
            continue
    return removed


_HOST_ID: str | None = None


def host_id() -> str:
    """Identity of the shared-memory filesystem this process sees: hostname, kernel boot id and the device of
    /dev/shm. Two processes may share an arena only when these agree; a file of the same name in another
    host's (or another mount namespace's) /dev/shm is a different segment."""
    global _HOST_ID
    if _HOST_ID is None:
        import socket

        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:  # not Linux: the hostname and the device still tell hosts apart
            boot = "?"
        try:
            dev = os.stat(SHM_DIR).st_dev
        except OSError:
            dev = -1
        _HOST_ID = f"{socket.gethostname()}/{boot}/{dev}"
    return _HOST_ID


def can_open(name: str) -> bool:
    """True when this process sees the same /dev/shm as the process that created ``name``."""
    return valid_arena_name(name) and os.path.exists(os.path.join(SHM_DIR, name))


class RangeAllocator:
    """First-fit allocator over [0, capacity) with coalescing of freed neighbours.

    Free blocks are kept sorted by offset; RL partitions are freed roughly in allocation order, so the
    free list stays short and first fit is effectively a bump allocator.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._starts: list[int] = [0]
        self._sizes: dict[int, int] = {0: capacity}

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new range of ``nbytes`` (rounded up to ALIGN), or None when it does not fit."""
        size = _round_up(max(nbytes, 1))
        for i, start in enumerate(self._starts):
            free = self._sizes[start]
            if free >= size:
                del self._sizes[start]
                if free == size:
                    del self._starts[i]
                else:
                    self._starts[i] = start + size
                    self._sizes[start + size] = free - size
                self.used += size
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return a range obtained from ``alloc`` with the same ``nbytes``."""
        size = _round_up(max(nbytes, 1))
        self.used -= size
        i = bisect.bisect_left(self._starts, offset)
        # Merge with the following block, then with the preceding one.
        if i < len(self._starts) and self._starts[i] == offset + size:
            size += self._sizes.pop(self._starts[i])
            del self._starts[i]
        if i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == offset:
            self._sizes[self._starts[i - 1]] += size
        else:
            self._starts.insert(i, offset)
            self._sizes[offset] = size

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return max(self._sizes.values(), default=0)


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
