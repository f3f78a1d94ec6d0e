//! The level-of-detail index: answers "what to draw for events [t0, t1) on `cols` × `rows` pixels" with at
//! most about `cols * BANDS_PER_COLUMN` bands. Allocations big enough on screen come back one by one; the
//! rest are merged into a coarse raster of "small blocks" cells per pixel column. The active-bytes level
//! comes back as a per-column max/min envelope read from max/min pyramids, so any window costs
//! O(cols · log) for the level plus a scan of the allocations that overlap it (chunks whose allocations
//! all ended before the window are skipped whole).

use crate::trace::{Alloc, Trace, ALIVE};

/// Allocations per chunk of the overlap index.
const CHUNK: usize = 1024;
/// Average individually drawn bands per pixel column, at most.
pub const BANDS_PER_COLUMN: usize = 8;
/// Height of one raster cell of merged small blocks, in pixels.
pub const CELL_PX: usize = 4;
/// Events per block at the pyramids' base: a column's partial blocks are read from the level itself
/// (at most 2·BLOCK values), whole blocks from the pyramids (16 bytes per block instead of per event).
const BLOCK: usize = 64;
/// A combining function of the level (max or min).
type Fold = fn(u64, u64) -> u64;

/// From this many allocations on, a query scans them in two threads.
const PARALLEL_MIN_ALLOCS: usize = 200_000;

/// The index over one trace's allocations and levels.
pub struct LodIndex {
    /// Per chunk of `CHUNK` allocations (sorted by t0): the latest end among them.
    chunk_max_t1: Vec<u32>,
    /// The active level after each event.
    level: Vec<u64>,
    /// Max and min per block of `BLOCK` events (the pyramids' base), and the pyramids above them:
    /// `max_up[k - 1][i]` = max over blocks [i·2^k, (i+1)·2^k).
    block_max: Vec<u64>,
    block_min: Vec<u64>,
    max_up: Vec<Vec<u64>>,
    min_up: Vec<Vec<u64>>,
}

/// One band as the page draws it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Band {
    pub id: u32,
    pub t0: u32,
    /// The end event (the trace's length when still alive).
    pub t1: u32,
    pub y: u64,
    pub size: u64,
    pub site: u32,
    pub cat: u8,
}

/// What a query asks for: events [t0, t1) and bytes [y0, y1) on `cols` × `rows` pixels.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub t0: f64,
    pub t1: f64,
    pub y0: f64,
    pub y1: f64,
    pub cols: usize,
    pub rows: usize,
}

/// The answer to a window query.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LodResult {
    pub t0: f64,
    pub t1: f64,
    pub cols: usize,
    pub rows: usize,
    /// The y axis' window (bytes).
    pub y0: f64,
    pub y1: f64,
    pub bands: Vec<Band>,
    /// Merged small blocks: (column, first cell, last cell) runs, cells of `CELL_PX` rows from the bottom.
    pub dust: Vec<(u32, u32, u32)>,
    /// Active bytes per column: max and min over the column's events.
    pub level_max: Vec<u64>,
    pub level_min: Vec<u64>,
    /// Allocations overlapping the window, in all.
    pub overlapping: usize,
}

/// The levels above `base`, each half the one below (combined with `f`).
fn pyramid(base: &[u64], f: fn(u64, u64) -> u64) -> Vec<Vec<u64>> {
    let mut levels: Vec<Vec<u64>> = Vec::new();
    loop {
        let prev = levels.last().map(Vec::as_slice).unwrap_or(base);
        if prev.len() <= 1 {
            return levels;
        }
        let next = prev.chunks(2).map(|c| c.iter().copied().reduce(f).unwrap_or(0)).collect();
        levels.push(next);
    }
}

/// `f` over base[lo..hi], combined from the largest aligned blocks of the pyramid `up` above `base`.
fn range_fold(base: &[u64], up: &[Vec<u64>], mut lo: usize, hi: usize, f: fn(u64, u64) -> u64, init: u64) -> u64 {
    let mut acc = init;
    while lo < hi {
        let mut k = 0;
        while k < up.len() && lo % (1 << (k + 1)) == 0 && lo + (1 << (k + 1)) <= hi {
            k += 1;
        }
        acc = f(acc, if k == 0 { base[lo] } else { up[k - 1][lo >> k] });
        lo += 1 << k;
    }
    acc
}

impl LodIndex {
    /// Indexes `allocs` (sorted by t0) and takes the active level after each event.
    pub fn build(allocs: &[Alloc], level: Vec<u64>) -> LodIndex {
        // The allocations' chunks and the level's blocks are indexed side by side (two threads).
        let (chunk_max_t1, (block_max, block_min)) = std::thread::scope(|s| {
            let blocks = s.spawn(|| {
                let max: Vec<u64> = level.chunks(BLOCK).map(|c| c.iter().copied().max().unwrap_or(0)).collect();
                let min: Vec<u64> = level.chunks(BLOCK).map(|c| c.iter().copied().min().unwrap_or(0)).collect();
                (max, min)
            });
            let chunks: Vec<u32> = allocs.chunks(CHUNK).map(|c| c.iter().map(|a| a.t1).max().unwrap_or(0)).collect();
            (chunks, blocks.join().expect("the LOD index thread panicked"))
        });
        LodIndex {
            chunk_max_t1,
            max_up: pyramid(&block_max, u64::max),
            min_up: pyramid(&block_min, u64::min),
            block_max,
            block_min,
            level,
        }
    }

    /// `f` over the level at events [lo, hi): partial blocks from the level, whole ones from the pyramid.
    fn level_fold(&self, lo: usize, hi: usize, max: bool) -> u64 {
        let (f, init, base, up): (Fold, u64, &[u64], &[Vec<u64>]) = if max {
            (u64::max, 0, &self.block_max, &self.max_up)
        } else {
            (u64::min, u64::MAX, &self.block_min, &self.min_up)
        };
        let (b0, b1) = (lo.div_ceil(BLOCK), hi / BLOCK);
        if b0 >= b1 {
            return self.level[lo..hi].iter().copied().fold(init, f);
        }
        let head = self.level[lo..b0 * BLOCK].iter().copied().fold(init, f);
        let tail = self.level[b1 * BLOCK..hi].iter().copied().fold(init, f);
        f(f(head, tail), range_fold(base, up, b0, b1, f, init))
    }

    /// The active level after event `e`.
    pub fn level_at(&self, e: usize) -> Option<u64> {
        self.level.get(e).copied()
    }

    /// Calls `f(id, alloc)` for every allocation alive at some event of [t0, t1).
    pub fn overlapping<'a>(&self, allocs: &'a [Alloc], t0: u32, t1: u32, f: impl FnMut(u32, &'a Alloc)) {
        self.overlapping_in(allocs, t0, t1, 0..self.chunk_max_t1.len(), f)
    }

    /// [`Self::overlapping`] over the chunks `chunks` only.
    fn overlapping_in<'a>(
        &self,
        allocs: &'a [Alloc],
        t0: u32,
        t1: u32,
        chunks: std::ops::Range<usize>,
        mut f: impl FnMut(u32, &'a Alloc),
    ) {
        for (c, &max_t1) in self.chunk_max_t1.iter().enumerate().take(chunks.end).skip(chunks.start) {
            let start = c * CHUNK;
            if allocs[start].t0 >= t1 {
                break;
            }
            if max_t1 != ALIVE && max_t1 <= t0 {
                continue;
            }
            for (k, a) in allocs[start..(start + CHUNK).min(allocs.len())].iter().enumerate() {
                if a.t0 < t1 && (a.t1 == ALIVE || a.t1 > t0) {
                    f((start + k) as u32, a);
                }
            }
        }
    }

    /// The bands, merged small blocks and level for events [t0, t1) and bytes [y0, y1) drawn on `cols` ×
    /// `rows` pixels; allocations in `keep` (search matches, the pinned one) always come back as bands.
    pub fn query(&self, trace: &Trace, w: Window, keep: &(dyn Fn(u32) -> bool + Sync)) -> LodResult {
        let (allocs, events) = (&trace.allocs[..], trace.events);
        let Window { t0, t1, y0, y1, cols, rows } = w;
        let cols = cols.clamp(1, 8192);
        let rows = rows.clamp(1, 8192);
        let t0 = t0.clamp(0.0, events as f64);
        let t1 = t1.clamp(t0 + 1e-6, events as f64 + 1.0);
        let y0 = y0.max(0.0);
        let y1 = y1.max(y0 + 1.0);
        let px_per_event = cols as f64 / (t1 - t0);
        let rows_per_byte = rows as f64 / (y1 - y0);
        // A band is drawn alone when it covers at least this many pixels: then at most
        // cols·rows/min_area of them fit without overlapping (the layout never overlaps).
        let min_area = (rows as f64 / BANDS_PER_COLUMN as f64).max(2.0);
        let cells = rows.div_ceil(CELL_PX);
        let mark = |grid: &mut Vec<bool>, a: &Alloc, x0: f64, x1: f64| {
            let c0 = (x0.floor() as usize).min(cols - 1);
            let c1 = ((x1.ceil() as usize).saturating_sub(1)).clamp(c0, cols - 1);
            let row = |b: f64| (((b - y0) * rows_per_byte).max(0.0) as usize / CELL_PX).min(cells - 1);
            let (r0, r1) = (row(a.y as f64), row((a.y + a.size_bytes) as f64));
            for c in c0..=c1 {
                for r in r0..=r1.max(r0) {
                    grid[c * cells + r] = true;
                }
            }
        };
        let (w0, w1) = (t0.floor() as u32, t1.ceil() as u32);
        // One scan of a range of chunks: its bands, its raster of merged blocks, how many overlap.
        let scan = |chunks: std::ops::Range<usize>| -> (Vec<Band>, Vec<bool>, usize) {
            let mut grid = vec![false; cols * cells];
            let mut bands = Vec::new();
            let mut overlapping = 0usize;
            self.overlapping_in(allocs, w0, w1, chunks, |id, a| {
                overlapping += 1;
                let end = if a.t1 == ALIVE { events } else { a.t1 };
                let x0 = ((a.t0 as f64).max(t0) - t0) * px_per_event;
                let x1 = ((end as f64).min(t1) - t0) * px_per_event;
                let (top, bottom) = ((a.y + a.size_bytes) as f64, a.y as f64);
                if top < y0 || bottom > y1 {
                    return;
                }
                let w = (x1 - x0).max(0.0);
                // A band less than a row tall still shows as one row.
                let h = (a.size_bytes as f64 * rows_per_byte).max(1.0);
                if w * h >= min_area || keep(id) {
                    bands.push(Band {
                        id,
                        t0: a.t0,
                        t1: end,
                        y: a.y,
                        size: a.size_bytes,
                        site: trace.site(id),
                        cat: trace.category(id),
                    });
                    return;
                }
                mark(&mut grid, a, x0, x1);
            });
            (bands, grid, overlapping)
        };
        // A long trace's scan is split in two threads (the machine this was written on has 2 cores).
        let n_chunks = self.chunk_max_t1.len();
        let (mut bands, mut grid, overlapping) = if allocs.len() >= PARALLEL_MIN_ALLOCS {
            let mid = n_chunks / 2;
            std::thread::scope(|s| {
                let later = s.spawn(|| scan(mid..n_chunks));
                let (mut bands, mut grid, n) = scan(0..mid);
                let (b2, g2, n2) = later.join().expect("the LOD scan thread panicked");
                bands.extend(b2);
                grid.iter_mut().zip(g2).for_each(|(g, h)| *g |= h);
                (bands, grid, n + n2)
            })
        } else {
            scan(0..n_chunks)
        };
        // Sub-row bands may overlap on screen: past the budget, the smallest on screen are merged too.
        let budget = cols * BANDS_PER_COLUMN;
        if bands.len() > budget {
            let area = |b: &Band| {
                let x0 = ((b.t0 as f64).max(t0) - t0) * px_per_event;
                let x1 = ((b.t1 as f64).min(t1) - t0) * px_per_event;
                (x1 - x0).max(0.0) * (b.size as f64 * rows_per_byte).max(1.0)
            };
            bands.sort_by(|a, b| {
                (keep(b.id), area(b)).partial_cmp(&(keep(a.id), area(a))).unwrap_or(std::cmp::Ordering::Equal)
            });
            for b in bands.drain(budget..) {
                let a = &allocs[b.id as usize];
                let end = if a.t1 == ALIVE { events } else { a.t1 };
                let x0 = ((a.t0 as f64).max(t0) - t0) * px_per_event;
                let x1 = ((end as f64).min(t1) - t0) * px_per_event;
                mark(&mut grid, a, x0, x1);
            }
        }
        let mut dust = Vec::new();
        for c in 0..cols {
            let mut r = 0;
            while r < cells {
                if grid[c * cells + r] {
                    let s = r;
                    while r + 1 < cells && grid[c * cells + r + 1] {
                        r += 1;
                    }
                    dust.push((c as u32, s as u32, r as u32));
                }
                r += 1;
            }
        }
        let (mut level_max, mut level_min) = (Vec::with_capacity(cols), Vec::with_capacity(cols));
        let n = self.level.len();
        for c in 0..cols {
            let a = (t0 + c as f64 / px_per_event).floor() as usize;
            let b = ((t0 + (c + 1) as f64 / px_per_event).ceil() as usize).max(a + 1);
            let (a, b) = (a.min(n), b.min(n));
            if a >= b {
                level_max.push(0);
                level_min.push(0);
                continue;
            }
            level_max.push(self.level_fold(a, b, true));
            level_min.push(self.level_fold(a, b, false));
        }
        LodResult { t0, t1, cols, rows, y0, y1, bands, dust, level_max, level_min, overlapping }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake trace for the pure logic: `n` small one-event allocations and one big long-lived one.
    fn fake(n: u32) -> (Trace, Vec<u64>) {
        let mut allocs = vec![Alloc { t0: 0, t1: ALIVE, y: 0, size_bytes: 1 << 30, addr: 1, stack: 0 }];
        for i in 0..n {
            allocs.push(Alloc { t0: i, t1: i + 1, y: 1 << 30, size_bytes: 512, addr: 2 + i as u64, stack: 0 });
        }
        let level: Vec<u64> = (0..n).map(|_| (1 << 30) + 512).collect();
        (Trace::fake(allocs, n), level)
    }

    #[test]
    fn a_million_small_blocks_come_back_bounded_and_zoom_reaches_one_block() {
        let n = 1_000_000;
        let (trace, level) = fake(n);
        let idx = LodIndex::build(&trace.allocs, level);
        let y_max = (1 << 30) + 512;
        let whole = Window { t0: 0.0, t1: n as f64, y0: 0.0, y1: y_max as f64, cols: 1000, rows: 400 };
        let r = idx.query(&trace, whole, &|_| false);
        assert_eq!(r.overlapping, n as usize + 1);
        assert!(r.bands.len() <= 1000 * BANDS_PER_COLUMN, "{}", r.bands.len());
        assert!(r.bands.iter().any(|b| b.id == 0), "the big block is drawn alone");
        assert!(!r.dust.is_empty(), "the small ones are merged, not dropped");
        assert_eq!(r.level_max.len(), 1000);
        assert!(r.level_max.iter().all(|&v| v == y_max));
        // Zoomed onto event 500000 and bytes near the small band: that one block is a band of its own.
        let y = (1u64 << 30) as f64;
        let near = Window { t0: 499_999.5, t1: 500_001.5, y0: y - 256.0, y1: y + 768.0, cols: 1000, rows: 400 };
        let r = idx.query(&trace, near, &|_| false);
        assert!(r.bands.iter().any(|b| b.id == 500_001), "{:?}", &r.bands);
        assert!(r.overlapping <= 4, "{}", r.overlapping);
        // A kept id (search hit) is a band whatever its size.
        let r = idx.query(&trace, whole, &|id| id == 77);
        assert!(r.bands.iter().any(|b| b.id == 77));
    }

    #[test]
    fn level_envelope_is_exact_per_column() {
        let level: Vec<u64> = (0..10_000u64).map(|i| (i * 7919) % 1000).collect();
        let idx = LodIndex::build(&[], level.clone());
        for (a, b) in [
            (0usize, 10_000usize),
            (3, 17),
            (100, 101),
            (511, 513),
            (1, 9_999),
            (0, 1),
            (9_999, 10_000),
            (63, 129),
            (64, 128),
            (64, 4_096),
            (70, 5_000),
        ] {
            let want_max = level[a..b].iter().max().copied().unwrap();
            let want_min = level[a..b].iter().min().copied().unwrap();
            assert_eq!(idx.level_fold(a, b, true), want_max, "{a}..{b}");
            assert_eq!(idx.level_fold(a, b, false), want_min, "{a}..{b}");
        }
    }
}
