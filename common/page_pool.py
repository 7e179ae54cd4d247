"""Which pages of a KV cache hold what: block tables, a prefix cache, LRU eviction.

A worker's KV cache is a pool of `num_pages` pages of `page_size` positions; the worker
owns the memory, the scheduler decides which page holds what. Each running sequence has a
block table: its pages in order, page i holding positions i*page_size .. (i+1)*page_size-1.

The prefix cache is a hash chain without the hash. Once a full page's keys and values are
computed, it is registered under (the prefix id of everything before it, its own token
ids) and gets a prefix id of its own, a number never used again. A key so names the
page's whole prefix exactly: two prompts share a page only if every token up to its end
is the same, and no collision can make them share one wrongly. The empty prefix is named
by the sequence's salt (a string, "" for none), so sequences with different salts share no
page at all: a cache hit, or its speed, can tell a client only what requests with its own
salt computed. A chain of full pages is
what sharing works in anyway (a radix tree would match single tokens, but a partial page
cannot be shared), and looking a page up is one dict access.

A new sequence takes the longest run of registered pages that holds its prompt's start,
but never its last token: at least one token is computed (its logits are wanted), so the
page a sequence writes is always its own and a shared page is only ever read. A page
nobody holds stays cached until its memory is needed: free pages are taken first, then
cached ones, the least recently released first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

UNSALTED = ""  # the salt of the cache everyone shares
Prefix = int | str  # a prefix id: a registered page's number, or the empty prefix named by its salt


@dataclass
class _Page:
    ref_count: int = 0
    key: tuple[Prefix, tuple[int, ...]] | None = None  # set while registered in the prefix cache
    prefix_id: int = 0  # while registered: the id of the prefix that ends with this page (from 1)


@dataclass
class _Table:
    pages: list[int] = field(default_factory=list)
    num_registered: int = 0  # its leading pages whose prefix is known (registered here or found already cached)
    prefix_id: Prefix = UNSALTED  # the prefix id after those pages (before any: the salt)


@dataclass
class PrefixCacheCounters:
    num_queried_tokens: int = 0  # prompt tokens looked up at admission
    num_hit_tokens: int = 0  # of those, found cached


class PagePool:
    def __init__(self, num_pages: int, page_size: int, *, prefix_cache: bool = True) -> None:
        """`prefix_cache` False: pages are never shared, and a sequence's pages are free again as it ends."""
        if num_pages < 1 or page_size < 1:
            raise ValueError(
                f"a page pool needs at least one page of at least one position, got {num_pages} x {page_size}"
            )
        self.page_size = page_size
        self.num_pages = num_pages
        self.prefix_cache = prefix_cache
        self._pages = [_Page() for _ in range(num_pages)]
        self._free = list(range(num_pages - 1, -1, -1))  # hold nothing worth keeping; popped from the end: page 0 first
        self._cached: OrderedDict[int, None] = (
            OrderedDict()
        )  # registered, held by nobody: least recently released first
        self._index: dict[tuple[Prefix, tuple[int, ...]], int] = {}  # registered pages by key
        self._tables: dict[str, _Table] = {}
        self._next_prefix_id = 1
        self.counters = PrefixCacheCounters()

    # ------------------------------------------------------------------ views

    @property
    def num_available(self) -> int:
        """Pages a sequence may take now: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Pages holding something: held by a sequence, or kept by the prefix cache."""
        return self.num_pages - len(self._free)

    @property
    def num_seqs(self) -> int:
        return len(self._tables)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._tables[seq_id].pages)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def cached_prefix(self, token_ids: Sequence[int], salt: str = UNSALTED) -> list[int]:
        """The registered pages holding the longest start of `token_ids` in full pages, its last token left out, among
        those registered under `salt`."""
        pages: list[int] = []
        if not self.prefix_cache:
            return pages
        prefix_id: Prefix = salt
        for start in range(0, len(token_ids) - 1 - self.page_size + 1, self.page_size):
            page = self._index.get((prefix_id, tuple(token_ids[start : start + self.page_size])))
            if page is None:
                break
            pages.append(page)
            prefix_id = self._pages[page].prefix_id
        return pages

    def flush(self) -> int:
        """Forget every cached page nobody holds (they become free); returns how many. Pages sequences hold stay."""
        flushed = list(self._cached)
        for page in flushed:
            self._forget(page)
            self._free.append(page)
        self._cached.clear()
        return len(flushed)

    # ------------------------------------------------------------------ sequences

    def admit(
        self, seq_id: str, token_ids: Sequence[int], *, keep_free: int = 0, share: bool = True, salt: str = UNSALTED
    ) -> int | None:
        """Give a new sequence pages for `token_ids`, sharing its cached prefix under `salt` (its own full pages are
        registered under it too); returns how many tokens were cached.

        None, changing nothing, when the pool cannot hold it now with `keep_free` pages still
        available after it (the watermark that leaves running sequences room to grow).
        `share` False: nothing cached is reused (the sequence's own full pages are still registered).
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds pages")
        prefix = self.cached_prefix(token_ids, salt) if share else []
        num_new = self.pages_for(len(token_ids)) - len(prefix)
        unheld_in_prefix = sum(1 for page in prefix if self._pages[page].ref_count == 0)
        if num_new + keep_free > self.num_available - unheld_in_prefix:
            return None
        for page in prefix:
            self._hold(page)
        table = _Table(prefix + [self._take() for _ in range(num_new)], len(prefix))
        table.prefix_id = self._pages[prefix[-1]].prefix_id if prefix else salt
        self._tables[seq_id] = table
        self.counters.num_queried_tokens += len(token_ids)
        self.counters.num_hit_tokens += len(prefix) * self.page_size
        return len(prefix) * self.page_size

    def grow(self, seq_id: str, num_tokens: int) -> bool:
        """Pages for `num_tokens` positions of the sequence; False, taking none, when too few are available."""
        table = self._tables[seq_id]
        num_new = self.pages_for(num_tokens) - len(table.pages)
        if num_new > self.num_available:
            return False
        table.pages += [self._take() for _ in range(num_new)]
        return True

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Keep only the pages `num_tokens` positions need (a rejected proposal's pages go back)."""
        table = self._tables[seq_id]
        keep = self.pages_for(num_tokens)
        if keep < table.num_registered:
            raise ValueError(
                f"sequence {seq_id!r}: cutting to {num_tokens} tokens would drop computed, registered pages"
            )
        for page in table.pages[keep:]:
            self._release(page)
        del table.pages[keep:]

    def register(self, seq_id: str, token_ids: Sequence[int]) -> None:
        """`token_ids` are the sequence's tokens whose keys and values are computed: its full pages become cacheable.

        A page whose prefix another page already holds stays the sequence's own (it is
        read through the cached one by later requests); the chain goes on from the
        cached prefix.
        """
        table = self._tables[seq_id]
        if not self.prefix_cache:
            return
        num_full = min(len(token_ids) // self.page_size, len(table.pages))
        for i in range(table.num_registered, num_full):
            key = (table.prefix_id, tuple(token_ids[i * self.page_size : (i + 1) * self.page_size]))
            cached = self._index.get(key)
            if cached is None:
                page = self._pages[table.pages[i]]
                page.key, page.prefix_id = key, self._next_prefix_id
                self._next_prefix_id += 1
                self._index[key] = table.pages[i]
                table.prefix_id = page.prefix_id
            else:
                table.prefix_id = self._pages[cached].prefix_id
        table.num_registered = max(table.num_registered, num_full)

    def release(self, seq_id: str) -> None:
        """The sequence ended (or was preempted): its pages go back, registered ones staying cached."""
        for page in self._tables.pop(seq_id).pages:
            self._release(page)

    # ------------------------------------------------------------------ pages

    def _hold(self, page: int) -> None:
        if self._pages[page].ref_count == 0:
            del self._cached[page]
        self._pages[page].ref_count += 1

    def _take(self) -> int:
        """A page nobody holds, for new content: a free one, else the least recently released cached one."""
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._cached.popitem(last=False)
            self._forget(page)
        self._pages[page].ref_count = 1
        return page

    def _release(self, page: int) -> None:
        state = self._pages[page]
        state.ref_count -= 1
        assert state.ref_count >= 0, f"page {page} released more often than held"
        if state.ref_count == 0:
            if state.key is not None:
                self._cached[page] = None
            else:
                self._free.append(page)

    def _forget(self, page: int) -> None:
        """Evict: the page leaves the prefix cache (pages keyed under its prefix become unreachable and age out)."""
        state = self._pages[page]
        if state.key is not None:
            del self._index[state.key]
        state.key, state.prefix_id = None, 0
