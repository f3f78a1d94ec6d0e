// torchmem view: the page's one script. Data comes from the server's JSON endpoints (api/...), or, in the
// offline page, from the embedded JSON data block answered by the local functions below. Every string from
// a file is put into the page with textContent, never as markup.
'use strict';
(function () {
  const $ = (s) => document.querySelector(s);
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmtB(b) {
    if (b === null || b === undefined) return '?';
    const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0, v = Math.abs(b);
    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return (b < 0 ? '-' : '') + (i === 0 ? v.toFixed(0) : v.toFixed(v < 10 ? 2 : 1)) + ' ' + u[i];
  }
  function fmtUs(us) {
    if (us === null || us === undefined) return '?';
    if (us < 1000) return us + ' µs';
    if (us < 1e6) return (us / 1000).toFixed(2) + ' ms';
    return (us / 1e6).toFixed(3) + ' s';
  }
  const PALETTE = ['#4c78a8', '#f58518', '#54a24b', '#e45756', '#72b7b2', '#eeca3b', '#b279a2', '#ff9da6', '#9d755d', '#bab0ac',
    '#1f77b4', '#2ca02c', '#9467bd', '#8c564b', '#17becf', '#bcbd22'];
  const CAT_COLOURS = ['#1f77b4', '#d62728', '#9467bd', '#2ca02c', '#7f7f7f', '#bcbd22'];
  const dataEl = document.getElementById('tm-data');
  const OFF = dataEl ? JSON.parse(dataEl.textContent) : null;

  // ---- offline answers (same shapes as the server's) ----
  const local = {
    meta: () => OFF.meta,
    lod: (p) => {
      const d = OFF.docs[p.doc], m = OFF.meta.docs[p.doc];
      const t0 = +p.t0, t1 = +p.t1, cols = +p.cols, rows = +p.rows, y0 = +(p.y0 || 0), y1 = +(p.y1 || m.y_max);
      const ppe = cols / (t1 - t0), rpb = rows / Math.max(1, y1 - y0), minArea = Math.max(2, rows / 8);
      const cells = Math.ceil(rows / 4), grid = new Uint8Array(cols * cells), bands = [];
      const hits = p.q ? searchIds(p.doc, p.q) : null;
      for (const a of d.allocs) {
        const [id, s, e, y, size, site, cat] = a;
        if (s >= t1 || e <= t0 || y + size < y0 || y > y1) continue;
        const x0 = (Math.max(s, t0) - t0) * ppe, x1 = (Math.min(e, t1) - t0) * ppe;
        const w = Math.max(0, x1 - x0), h = size * rpb;
        if (w * Math.max(h, 1) >= minArea || (hits && hits.has(id)) || +p.pin === id) {
          bands.push({ id, t0: s, t1: e, y, size, site, cat });
          continue;
        }
        const c0 = Math.min(cols - 1, Math.floor(x0)), c1 = Math.max(c0, Math.min(cols - 1, Math.ceil(x1) - 1));
        const r0 = Math.max(0, Math.min(cells - 1, Math.floor((y - y0) * rpb / 4)));
        const r1 = Math.max(r0, Math.min(cells - 1, Math.floor((y + size - y0) * rpb / 4)));
        for (let c = c0; c <= c1; c++) for (let r = r0; r <= r1; r++) grid[c * cells + r] = 1;
      }
      const dust = [];
      for (let c = 0; c < cols; c++) {
        for (let r = 0; r < cells; r++) {
          if (!grid[c * cells + r]) continue;
          const s = r;
          while (r + 1 < cells && grid[c * cells + r + 1]) r++;
          dust.push([c, s, r]);
        }
      }
      const L = d.level_max.length, ev = m.events;
      const lmax = [], lmin = [];
      for (let c = 0; c < cols; c++) {
        const a = Math.floor((t0 + c / ppe) / ev * L), b = Math.max(a + 1, Math.ceil((t0 + (c + 1) / ppe) / ev * L));
        let mx = 0, mn = Infinity;
        for (let k = Math.max(0, a); k < Math.min(L, b); k++) { mx = Math.max(mx, d.level_max[k]); mn = Math.min(mn, d.level_min[k]); }
        lmax.push(mx); lmin.push(mn === Infinity ? 0 : mn);
      }
      return { t0, t1, cols, rows, y0, y1, bands, dust, level_max: lmax, level_min: lmin, overlapping: bands.length };
    },
    block: (p) => offBlock(+p.doc, +p.id),
    hit: (p) => {
      const d = OFF.docs[p.doc], t = +p.t, y = +p.y;
      for (const a of d.allocs) if (a[1] <= t && t < a[2] && a[3] <= y && y < a[3] + Math.max(1, a[4])) return offBlock(+p.doc, a[0]);
      return null;
    },
    segments: (p) => Object.assign({ offline_note: 'the offline page holds the segments at the peak only' }, OFF.docs[p.doc].segments_at_peak),
    icicle: (p) => OFF.docs[p.doc].icicle_at_peak,
    diff: () => OFF.diff,
    search: (p) => { const ids = [...searchIds(+p.doc, p.q)]; return { q: p.q, ids: ids.slice(0, 10000), total: ids.length }; },
    profile: (p) => OFF.docs[p.doc].query,
  };
  function searchIds(doc, q) {
    const d = OFF.docs[doc], m = OFF.meta.docs[doc], needle = String(q).toLowerCase().trim(), out = new Set();
    if (!needle) return out;
    const fhit = d.frames.map((f) => f.toLowerCase().includes(needle));
    const shit = d.stacks.map((s) => s.some((f) => fhit[f]));
    for (const a of d.allocs) if (shit[a[7]] || String(m.sites[a[5]] || '').toLowerCase().includes(needle)) out.add(a[0]);
    return out;
  }
  function offBlock(doc, id) {
    const d = OFF.docs[doc], m = OFF.meta.docs[doc];
    const a = d.allocs.find((r) => r[0] === id);
    if (!a) return null;
    return { id, size: a[4], t0: a[1], t1: a[2] >= m.events ? null : a[2], site: m.sites[a[5]], category: m.categories[a[6]],
      before_history: !!a[8], stack: d.stacks[a[7]].map((f) => d.frames[f]), time0_us: null, time1_us: null, lifetime_us: null };
  }
  async function api(route, params) {
    if (OFF) return local[route](params);
    const r = await fetch('api/' + route + '?' + new URLSearchParams(params).toString(), { cache: 'no-store' });
    if (!r.ok) throw new Error(await r.text());
    return r.json();
  }

  // ---- state ----
  let META = null;
  const panels = [];
  let colourBy = 'site';
  let query = '';
  let searchHits = [];
  const tip = $('#tip');
  const status = (s) => { $('#status').textContent = s; };
  const PADL = 64, PADB = 20;

  function colour(p, b) {
    if (colourBy === 'category') return CAT_COLOURS[b.cat] || '#999';
    return PALETTE[(b.site * 7919) % PALETTE.length];
  }

  function frameList(stack) {
    const box = el('div', 'frames');
    for (const f of stack || []) {
      const lib = /\/(torch|site-packages|dist-packages|lib\/python3)[^/]*\//.test(f) || !/\.py:/.test(f);
      box.appendChild(el('div', lib ? '' : 'user', f));
    }
    if (!stack || !stack.length) box.appendChild(el('div', '', '(no frames recorded)'));
    return box;
  }
  function blockInfo(b, into) {
    into.replaceChildren();
    const life = b.t1 === null ? 'alive at the end of the trace' : 'events ' + b.t0 + ' → ' + b.t1 + (b.lifetime_us !== null && b.lifetime_us !== undefined ? ' (' + fmtUs(b.lifetime_us) + ')' : '');
    const head = el('div');
    head.appendChild(el('b', '', fmtB(b.size)));
    head.appendChild(document.createTextNode(' · ' + life + (b.before_history ? ' · allocated before the trace' : '')));
    into.appendChild(head);
    into.appendChild(el('div', '', 'site: ' + (b.site || '?')));
    into.appendChild(el('div', '', 'category: ' + b.category + (b.addr ? ' · ' + b.addr : '') + ' · allocation #' + b.id));
    into.appendChild(frameList(b.stack));
  }

  // ---- memory panel ----
  function MemoryPanel(i, m, root) {
    const p = { i, m, type: 'memory', t0: 0, t1: m.events, y0: 0, y1: m.y_max, res: null, pin: null, hoverId: null, seq: 0, blocks: new Map() };
    const sec = el('section', 'panel');
    sec.dataset.doc = i;
    sec.appendChild(el('h2', '', m.name + ' (' + m.kind + ', device ' + m.device + ')'));
    sec.appendChild(el('div', 'meta', m.events + ' events · ' + m.allocations + ' allocations · traced peak ' + fmtB(m.peak_bytes) + ' after event ' + m.peak_event + (m.ooms.length ? ' · ' + m.ooms.length + ' OOM event(s)' : '')));
    const chart = el('div', 'chart');
    const cv = el('canvas');
    cv.height = 380;
    cv.tabIndex = 0;
    chart.appendChild(cv);
    sec.appendChild(chart);
    const legend = el('div', 'legend');
    sec.appendChild(legend);
    const segSum = el('div', 'segsum', '');
    const segCv = el('canvas');
    segCv.height = 150;
    sec.appendChild(el('h2', '', 'Segments at a moment (blue: allocated blocks, grey: free bytes inside reserved segments)'));
    sec.appendChild(segSum);
    const segChart = el('div', 'chart');
    segChart.appendChild(segCv);
    sec.appendChild(segChart);
    sec.appendChild(el('h2', '', 'Composition at that moment (icicle of Python stacks, outermost frame on top)'));
    const iceSum = el('div', 'segsum icesum', '');
    sec.appendChild(iceSum);
    const iceCv = el('canvas');
    iceCv.height = 240;
    const iceChart = el('div', 'chart');
    iceChart.appendChild(iceCv);
    sec.appendChild(iceChart);
    const detail = el('div', 'detail');
    sec.appendChild(detail);
    root.appendChild(sec);
    Object.assign(p, { sec, cv, chart, legend, segSum, segCv, iceSum, iceCv, detail });
    iceCv.addEventListener('mousemove', (ev) => {
      const r = iceCv.getBoundingClientRect(), x = ev.clientX - r.left, y = ev.clientY - r.top;
      const hit = (p.iceRects || []).find((q) => x >= q.x && x < q.x + q.w && y >= q.y && y < q.y + q.h);
      if (!hit) { tip.hidden = true; return; }
      const total = p.iceRects[0].n.bytes || 1;
      tip.replaceChildren(el('b', '', fmtB(hit.n.bytes) + ' (' + (100 * hit.n.bytes / total).toFixed(1) + '%)'), el('div', 'frames', hit.n.name));
      tip.hidden = false;
      tip.style.left = Math.min(window.innerWidth - 660, ev.clientX + 14) + 'px';
      tip.style.top = (ev.clientY + 14) + 'px';
    });
    iceCv.addEventListener('mouseleave', () => { tip.hidden = true; });
    // record_function annotations (optimizer step, zero_grad, user ranges) as a lane above the bands
    p.spans = m.annotations || [];
    p.lanes = ['annotation', 'epoch', 'step', 'phase', 'mark'].filter((l) => p.spans.some((s) => s.lane === l));
    const LANE_H = 16;
    p.top = p.lanes.length ? LANE_H * p.lanes.length + 2 : 0;
    p.plotW = () => Math.max(10, cv.width - PADL);
    p.plotH = () => cv.height - PADB - p.top;
    p.xOf = (t) => PADL + (t - p.t0) / (p.t1 - p.t0) * p.plotW();
    p.yOf = (b) => p.top + p.plotH() - (b - p.y0) / (p.y1 - p.y0) * p.plotH();
    p.tAt = (x) => p.t0 + (x - PADL) / p.plotW() * (p.t1 - p.t0);
    p.bAt = (y) => p.y0 + (p.top + p.plotH() - y) / p.plotH() * (p.y1 - p.y0);
    p.spanAt = (t, y) => {
      const lane = p.lanes[Math.floor(y / LANE_H)];
      return p.spans.find((s) => s.lane === lane && s.e0 <= t && t <= Math.max(s.e1, s.e0 + (p.t1 - p.t0) / p.plotW() * 3));
    };
    p.laneY = (lane) => p.lanes.indexOf(lane) * LANE_H;
    p.full = () => { p.t0 = 0; p.t1 = m.events; p.y0 = 0; p.y1 = m.y_max; };
    p.clamp = () => {
      const span = Math.max(0.5, Math.min(m.events, p.t1 - p.t0));
      if (p.t0 < 0) p.t0 = 0;
      if (p.t0 + span > m.events) p.t0 = m.events - span;
      p.t1 = p.t0 + span;
      const ys = Math.max(1, Math.min(m.y_max, p.y1 - p.y0));
      if (p.y0 < 0) p.y0 = 0;
      if (p.y0 + ys > m.y_max) p.y0 = m.y_max - ys;
      p.y1 = p.y0 + ys;
    };
    p.draw = () => draw(p);
    p.fetch = () => fetchLod(p);
    p.bandRect = (id) => {
      const b = p.res && p.res.bands.find((x) => x.id === id);
      if (!b) return null;
      const r = cv.getBoundingClientRect();
      const x0 = Math.max(PADL, p.xOf(b.t0)), x1 = Math.min(cv.width, p.xOf(b.t1));
      const yTop = Math.max(p.top, p.yOf(b.y + b.size)), yBot = Math.min(p.top + p.plotH(), p.yOf(b.y));
      return { left: r.left + x0, top: r.top + yTop, width: x1 - x0, height: yBot - yTop };
    };
    // OOM markers
    p.oomEls = m.ooms.map((o) => {
      const d = el('div', 'oom');
      d.appendChild(el('span', '', 'OOM: ' + fmtB(o.requested_bytes) + ' requested' + (o.device_free_bytes !== null && o.device_free_bytes !== undefined ? ', ' + fmtB(o.device_free_bytes) + ' free on the device' : '')));
      d.dataset.event = o.event;
      chart.appendChild(d);
      return d;
    });
    wire(p);
    return p;
  }

  function draw(p) {
    const cv = p.cv, g = cv.getContext('2d');
    const w = cv.clientWidth || 800;
    if (cv.width !== w) cv.width = w;
    g.clearRect(0, 0, cv.width, cv.height);
    g.fillStyle = '#fff';
    g.fillRect(PADL, p.top, p.plotW(), p.plotH());
    const res = p.res;
    g.save();
    g.beginPath();
    g.rect(PADL, 0, p.plotW(), p.top + p.plotH());
    g.clip();
    g.font = '11px system-ui,sans-serif';
    g.textAlign = 'left';
    for (const s of p.spans) {
      const x0 = p.xOf(s.e0), x1 = Math.max(x0 + 2, p.xOf(s.e1));
      if (x1 < PADL || x0 > cv.width) continue;
      const ly = p.laneY(s.lane);
      g.fillStyle = PALETTE[(s.name.length * 5 + p.lanes.indexOf(s.lane)) % PALETTE.length];
      g.fillRect(x0, ly + 1, x1 - x0, 14);
      if (x1 - x0 > 50) { g.fillStyle = '#fff'; g.fillText(s.name, Math.max(PADL, x0) + 2, ly + 12, x1 - Math.max(PADL, x0) - 4); }
    }
    if (res) {
      // merged small blocks, in the query's columns and cells
      g.fillStyle = 'rgba(120,120,120,0.45)';
      const ce = (res.t1 - res.t0) / res.cols, rb = (res.y1 - res.y0) / res.rows;
      for (const [c, r0, r1] of res.dust) {
        const x0 = p.xOf(res.t0 + c * ce), x1 = p.xOf(res.t0 + (c + 1) * ce);
        const yb = p.yOf(res.y0 + r0 * 4 * rb), yt = p.yOf(res.y0 + (r1 + 1) * 4 * rb);
        g.fillRect(x0, yt, Math.max(1, x1 - x0), Math.max(1, yb - yt));
      }
      const hits = new Set(searchHits[p.i] || []);
      for (const b of res.bands) {
        const x0 = p.xOf(b.t0), x1 = p.xOf(b.t1), yt = p.yOf(b.y + b.size), yb = p.yOf(b.y);
        g.fillStyle = colour(p, b);
        g.globalAlpha = hits.size && !hits.has(b.id) ? 0.25 : 1;
        g.fillRect(x0, yt, Math.max(1, x1 - x0), Math.max(1, yb - yt));
      }
      g.globalAlpha = 1;
      for (const b of res.bands) {
        const marked = hits.has(b.id), pinned = b.id === p.pin, hov = b.id === p.hoverId;
        if (!marked && !pinned && !hov) continue;
        g.strokeStyle = pinned ? '#d62728' : hov ? '#000' : '#ff0';
        g.lineWidth = pinned || hov ? 2 : 1.5;
        const x0 = p.xOf(b.t0), x1 = p.xOf(b.t1), yt = p.yOf(b.y + b.size), yb = p.yOf(b.y);
        g.strokeRect(x0, yt, Math.max(1, x1 - x0), Math.max(1, yb - yt));
      }
      // the exact active level (max per column)
      g.strokeStyle = '#000';
      g.lineWidth = 1;
      g.beginPath();
      const lc = (res.t1 - res.t0) / res.level_max.length;
      res.level_max.forEach((v, c) => {
        const x = p.xOf(res.t0 + (c + 0.5) * lc), y = p.yOf(v);
        if (c === 0) g.moveTo(x, y); else g.lineTo(x, y);
      });
      g.stroke();
    }
    g.restore();
    g.fillStyle = '#555';
    g.textAlign = 'right';
    for (const l of p.lanes) g.fillText(l, PADL - 4, p.laneY(l) + 12);
    // axes
    g.fillStyle = '#333';
    g.font = '11px system-ui,sans-serif';
    g.textAlign = 'right';
    for (let k = 0; k <= 4; k++) {
      const v = p.y0 + (p.y1 - p.y0) * k / 4, y = p.yOf(v);
      g.fillText(fmtB(Math.round(v)), PADL - 4, Math.max(10, y + 3));
      g.fillRect(PADL - 3, y, 3, 1);
    }
    g.textAlign = 'center';
    for (let k = 0; k <= 5; k++) {
      const t = p.t0 + (p.t1 - p.t0) * k / 5;
      g.fillText('event ' + Math.round(t), Math.min(cv.width - 40, Math.max(PADL + 30, p.xOf(t))), cv.height - 5);
    }
    for (const d of p.oomEls) {
      const x = p.xOf(+d.dataset.event);
      d.hidden = x < PADL || x > cv.width;
      d.style.left = x + 'px';
      d.classList.toggle('left', x > cv.width - 260);
    }
    document.body.dataset.rendered = String((+document.body.dataset.rendered || 0) + 1);
  }

  let lodTimer = null;
  function fetchLod(p) {
    const seq = ++p.seq;
    const params = { doc: p.i, t0: p.t0, t1: p.t1, y0: p.y0, y1: p.y1, cols: Math.round(p.plotW()), rows: Math.round(p.plotH()) };
    if (query) params.q = query;
    if (p.pin !== null) params.pin = p.pin;
    const started = performance.now();
    return api('lod', params).then((r) => {
      if (seq !== p.seq) return;
      r.y0 = r.y0 === undefined ? p.y0 : r.y0;
      r.y1 = r.y1 === undefined ? p.y1 : r.y1;
      p.res = r;
      p.draw();
      p.sec.dataset.bands = r.bands.length;
      status(r.bands.length + ' bands, ' + r.dust.length + ' merged runs of small blocks, ' + r.overlapping + ' allocations in view (' + Math.round(performance.now() - started) + ' ms)');
      updateLegend(p);
    }).catch((e) => status('error: ' + e.message));
  }
  function refresh(p) {
    p.draw();
    clearTimeout(lodTimer);
    lodTimer = setTimeout(() => panels.forEach((q) => q.fetch && q.fetch()), 40);
  }
  function syncFrom(p) {
    // diff: the other traces show the same fraction of their trace
    for (const q of panels) {
      if (q === p || q.type !== p.type || q.type !== 'memory') continue;
      q.t0 = p.t0 / p.m.events * q.m.events;
      q.t1 = p.t1 / p.m.events * q.m.events;
      q.clamp();
      q.draw();
    }
  }
  function zoomX(p, f, atX) {
    const t = p.tAt(atX === undefined ? PADL + p.plotW() / 2 : atX);
    p.t0 = t - (t - p.t0) * f;
    p.t1 = t + (p.t1 - t) * f;
    p.clamp(); syncFrom(p); refresh(p);
  }
  function zoomY(p, f, atY) {
    const b = p.bAt(atY === undefined ? p.top + p.plotH() / 2 : atY);
    p.y0 = b - (b - p.y0) * f;
    p.y1 = b + (p.y1 - b) * f;
    p.clamp(); refresh(p);
  }
  function pan(p, dxPx, dyPx) {
    const dt = dxPx / p.plotW() * (p.t1 - p.t0), db = dyPx / p.plotH() * (p.y1 - p.y0);
    p.t0 -= dt; p.t1 -= dt; p.y0 += db; p.y1 += db;
    p.clamp(); syncFrom(p); refresh(p);
  }
  function zoomToBlock(p, b) {
    const end = b.t1 === null || b.t1 === undefined ? p.m.events : b.t1;
    const life = Math.max(1, end - b.t0);
    p.t0 = b.t0 - life * 0.25; p.t1 = end + life * 0.25;
    p.y0 = 0; p.y1 = p.m.y_max;
    if (b.y !== undefined) {
      const pad = Math.max(b.size, 1) * 0.5;
      p.y0 = b.y - pad; p.y1 = b.y + b.size + pad;
    }
    p.clamp(); syncFrom(p); refresh(p);
  }

  async function blockDetail(p, id) {
    if (!p.blocks.has(id)) p.blocks.set(id, await api('block', { doc: p.i, id }));
    return p.blocks.get(id);
  }
  function localHit(p, t, y) {
    if (!p.res) return null;
    for (const b of p.res.bands) if (b.t0 <= t && t < b.t1 && b.y <= y && y < b.y + Math.max(b.size, 1)) return b.id;
    return null;
  }
  function showTip(ev, b) {
    blockInfo(b, tip);
    tip.hidden = false;
    const x = Math.min(window.innerWidth - 660, ev.clientX + 14);
    tip.style.left = Math.max(0, x) + 'px';
    tip.style.top = Math.min(window.innerHeight - 200, ev.clientY + 14) + 'px';
  }
  async function showSegments(p, t) {
    const s = await api('segments', { doc: p.i, t: Math.floor(t) });
    const free = s.reserved_bytes - s.allocated_bytes;
    p.segSum.textContent = 'After event ' + s.t + ': ' + s.segments.length + ' segments reserve ' + fmtB(s.reserved_bytes) + ', blocks allocate ' + fmtB(s.allocated_bytes) + ', free inside segments ' + fmtB(free) + (s.reserved_bytes ? ' (' + (100 * free / s.reserved_bytes).toFixed(1) + '% of reserved)' : '') + (s.offline_note ? ' — ' + s.offline_note : '');
    p.segSum.dataset.freeBytes = free;
    const cv = p.segCv, g = cv.getContext('2d');
    cv.width = cv.clientWidth || 800;
    g.clearRect(0, 0, cv.width, cv.height);
    const rows = 6, rowH = cv.height / rows, W = cv.width;
    const scale = s.reserved_bytes ? (W * rows * 0.92) / s.reserved_bytes : 0;
    let x = 0, r = 0;
    p.segRects = [];
    for (const seg of s.segments) {
      const w = Math.max(2, seg.total_bytes * scale);
      if (x + w > W && x > 0) { x = 0; r++; }
      if (r >= rows) break;
      const y = r * rowH + 2;
      g.fillStyle = '#ddd';
      g.fillRect(x, y, w, rowH - 4);
      g.fillStyle = '#4c78a8';
      for (const [off, size, id] of seg.blocks) g.fillRect(x + off * scale, y, Math.max(0.5, size * scale), rowH - 4);
      p.segRects.push({ x, y, w, h: rowH - 4, seg });
      x += w + 2;
    }
  }
  async function showIcicle(p, t) {
    const r = await api('icicle', t === undefined ? { doc: p.i } : { doc: p.i, t: Math.floor(t) });
    const cv = p.iceCv, g = cv.getContext('2d');
    cv.width = cv.clientWidth || 800;
    g.clearRect(0, 0, cv.width, cv.height);
    g.font = '11px system-ui,sans-serif';
    g.textAlign = 'left';
    const rowH = 18, total = r.root.bytes || 1;
    p.iceRects = [];
    const draw = (n, x, w, depth) => {
      if (w < 0.5 || (depth + 1) * rowH > cv.height) return;
      const y = depth * rowH;
      g.fillStyle = depth === 0 ? '#888' : n.name === '(smaller)' ? '#ccc' : PALETTE[(n.name.length * 7 + depth) % PALETTE.length];
      g.fillRect(x, y, Math.max(0.5, w - 1), rowH - 1);
      p.iceRects.push({ x, y, w, h: rowH, n });
      if (w > 60) {
        g.fillStyle = '#fff';
        const label = depth === 0 ? 'all: ' + fmtB(n.bytes) : n.name.replace(/^.*\//, '');
        g.fillText(label, x + 3, y + 13, w - 6);
      }
      let cx = x;
      for (const c of n.children) { const cw = w * c.bytes / Math.max(1, n.bytes); draw(c, cx, cw, depth + 1); cx += cw; }
    };
    draw(r.root, 0, cv.width, 0);
    p.iceSum.textContent = 'After event ' + r.t + ': ' + fmtB(total) + ' alive' + (OFF ? ' (the offline page holds the peak only)' : '') + '; hover a frame for its bytes.';
    p.iceSum.dataset.bytes = total;
  }
  function updateLegend(p) {
    const counts = new Map();
    for (const b of p.res.bands) {
      const k = colourBy === 'category' ? b.cat : b.site;
      counts.set(k, (counts.get(k) || 0) + b.size);
    }
    const top = [...counts.entries()].sort((a, b) => b[1] - a[1]).slice(0, 12);
    p.legend.replaceChildren();
    for (const [k] of top) {
      const item = el('span');
      const sw = el('i');
      sw.style.background = colourBy === 'category' ? CAT_COLOURS[k] : PALETTE[(k * 7919) % PALETTE.length];
      item.appendChild(sw);
      item.appendChild(document.createTextNode(colourBy === 'category' ? p.m.categories[k] : p.m.sites[k]));
      p.legend.appendChild(item);
    }
  }

  function wire(p) {
    const cv = p.cv;
    let drag = null, hoverTimer = null;
    cv.addEventListener('wheel', (ev) => {
      ev.preventDefault();
      const r = cv.getBoundingClientRect(), f = Math.exp(ev.deltaY * 0.0015);
      if (ev.shiftKey) zoomY(p, f, ev.clientY - r.top); else zoomX(p, f, ev.clientX - r.left);
    }, { passive: false });
    cv.addEventListener('mousedown', (ev) => { drag = { x: ev.clientX, y: ev.clientY, moved: false }; });
    window.addEventListener('mouseup', () => { setTimeout(() => { drag = null; }, 0); });
    cv.addEventListener('mousemove', (ev) => {
      const r = cv.getBoundingClientRect(), x = ev.clientX - r.left, y = ev.clientY - r.top;
      if (drag && (ev.buttons & 1)) {
        const dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
        if (Math.abs(dx) + Math.abs(dy) > 2) {
          drag.moved = true;
          pan(p, dx, p.y1 - p.y0 < p.m.y_max ? dy : 0);
          drag.x = ev.clientX; drag.y = ev.clientY;
        }
        return;
      }
      if (x < PADL || y > p.top + p.plotH()) { tip.hidden = true; return; }
      const t = p.tAt(x), by = p.bAt(y);
      if (y < p.top) {
        const s = p.spanAt(t, y);
        if (!s) { tip.hidden = true; return; }
        const what = s.lane === 'annotation' ? 'record_function annotation' : s.lane + ' from the run profile';
        tip.replaceChildren(el('b', '', s.name), el('div', '', 'events ' + s.e0 + ' → ' + s.e1 + ' (' + what + ')'));
        tip.hidden = false;
        tip.style.left = (ev.clientX + 14) + 'px';
        tip.style.top = (ev.clientY + 14) + 'px';
        return;
      }
      const id = localHit(p, t, by);
      clearTimeout(hoverTimer);
      const show = (id2) => {
        if (id2 === null || id2 === undefined) { tip.hidden = true; p.hoverId = null; p.draw(); return; }
        blockDetail(p, id2).then((b) => { p.hoverId = id2; p.draw(); showTip(ev, b); });
      };
      if (id !== null) show(id);
      else hoverTimer = setTimeout(() => api('hit', { doc: p.i, t, y: by }).then((b) => {
        if (b) { p.blocks.set(b.id, b); show(b.id); } else show(null);
      }), 60);
    });
    cv.addEventListener('mouseleave', () => { tip.hidden = true; p.hoverId = null; p.draw(); });
    cv.addEventListener('click', async (ev) => {
      if (drag && drag.moved) return;
      const r = cv.getBoundingClientRect(), x = ev.clientX - r.left, y = ev.clientY - r.top;
      const t = p.tAt(x), by = p.bAt(y);
      let id = localHit(p, t, by);
      if (id === null) { const b = await api('hit', { doc: p.i, t, y: by }); id = b ? b.id : null; if (b) p.blocks.set(b.id, b); }
      pin(p, id);
      showSegments(p, t);
      showIcicle(p, t);
    });
    cv.addEventListener('dblclick', async () => {
      if (p.pin === null) return;
      const b = p.res.bands.find((x) => x.id === p.pin);
      if (b) zoomToBlock(p, b);
    });
  }
  async function pin(p, id) {
    p.pin = id;
    p.detail.replaceChildren();
    if (id !== null) {
      const b = await blockDetail(p, id);
      p.detail.appendChild(el('h2', '', 'Pinned allocation'));
      const box = el('div');
      blockInfo(b, box);
      p.detail.appendChild(box);
    }
    p.draw();
  }

  // ---- profile panel ----
  function ProfilePanel(i, m, root) {
    const p = { i, m, type: 'profile', t0: 0, t1: m.end_ns, res: null, seq: 0 };
    const sec = el('section', 'panel');
    sec.dataset.doc = i;
    sec.appendChild(el('h2', '', m.name + ' (' + m.kind + ')'));
    sec.appendChild(el('div', 'meta', m.command));
    const chart = el('div', 'chart');
    const cv = el('canvas');
    cv.height = 420;
    chart.appendChild(cv);
    sec.appendChild(chart);
    const legend = el('div', 'legend');
    sec.appendChild(legend);
    root.appendChild(sec);
    Object.assign(p, { sec, cv, legend });
    const LANES = ['epoch', 'step', 'phase', 'mark'], laneH = 18, top = LANES.length * laneH + 6;
    p.plotW = () => Math.max(10, cv.width - PADL);
    p.xOf = (t) => PADL + (t - p.t0) / (p.t1 - p.t0) * p.plotW();
    p.tAt = (x) => p.t0 + (x - PADL) / p.plotW() * (p.t1 - p.t0);
    p.clamp = () => {
      const span = Math.max(1000, Math.min(m.end_ns, p.t1 - p.t0));
      if (p.t0 < 0) p.t0 = 0;
      if (p.t0 + span > m.end_ns) p.t0 = m.end_ns - span;
      p.t1 = p.t0 + span;
    };
    p.fetch = () => {
      const seq = ++p.seq;
      return api('profile', { doc: i, t0: p.t0, t1: p.t1, cols: Math.round(p.plotW()) }).then((r) => {
        if (seq === p.seq) { p.res = r; p.draw(); }
      });
    };
    p.draw = () => {
      const w = cv.clientWidth || 800;
      if (cv.width !== w) cv.width = w;
      const g = cv.getContext('2d');
      g.clearRect(0, 0, cv.width, cv.height);
      const r = p.res;
      if (!r) return;
      const H = cv.height - PADB - top, ymax = m.y_max || 1;
      const yOf = (v) => top + H - v / ymax * H;
      g.font = '11px system-ui,sans-serif';
      LANES.forEach((lane, k) => { g.fillStyle = '#555'; g.textAlign = 'right'; g.fillText(lane, PADL - 4, k * laneH + 13); });
      p.spanRects = [];
      for (const s of r.spans) {
        const k = LANES.indexOf(s.lane), x0 = p.xOf(s.t0_ns), x1 = Math.max(x0 + 1, p.xOf(s.t1_ns));
        g.fillStyle = PALETTE[(k * 3 + s.name.length) % PALETTE.length];
        g.fillRect(Math.max(PADL, x0), k * laneH + 2, Math.min(cv.width, x1) - Math.max(PADL, x0), laneH - 4);
        if (x1 - x0 > 40) { g.fillStyle = '#fff'; g.textAlign = 'left'; g.fillText(s.name, Math.max(PADL, x0) + 2, k * laneH + 13, x1 - x0 - 4); }
        p.spanRects.push({ x0, x1, y: k * laneH, s });
      }
      const cols = r.cols, ce = (r.t1 - r.t0) / cols;
      legend.replaceChildren();
      r.series.forEach((s, k) => {
        g.strokeStyle = PALETTE[k % PALETTE.length];
        g.beginPath();
        let started = false;
        for (let c = 0; c < cols; c++) {
          if (s.max[c] === null) continue;
          const x = p.xOf(r.t0 + (c + 0.5) * ce);
          if (!started) { g.moveTo(x, yOf(s.max[c])); started = true; } else g.lineTo(x, yOf(s.max[c]));
        }
        g.stroke();
        const item = el('span'), sw = el('i');
        sw.style.background = PALETTE[k % PALETTE.length];
        item.appendChild(sw);
        item.appendChild(document.createTextNode(s.name));
        legend.appendChild(item);
      });
      g.fillStyle = '#333';
      g.textAlign = 'right';
      for (let k = 0; k <= 4; k++) g.fillText(fmtB(Math.round(ymax * k / 4)), PADL - 4, yOf(ymax * k / 4) + 3);
      g.textAlign = 'center';
      for (let k = 0; k <= 5; k++) { const t = p.t0 + (p.t1 - p.t0) * k / 5; g.fillText((t / 1e9).toFixed(3) + ' s', Math.min(cv.width - 30, Math.max(PADL + 20, p.xOf(t))), cv.height - 5); }
      document.body.dataset.rendered = String((+document.body.dataset.rendered || 0) + 1);
    };
    cv.addEventListener('wheel', (ev) => {
      ev.preventDefault();
      const rc = cv.getBoundingClientRect(), t = p.tAt(ev.clientX - rc.left), f = Math.exp(ev.deltaY * 0.0015);
      p.t0 = t - (t - p.t0) * f; p.t1 = t + (p.t1 - t) * f; p.clamp(); refresh(p);
    }, { passive: false });
    let drag = null;
    cv.addEventListener('mousedown', (ev) => { drag = ev.clientX; });
    window.addEventListener('mouseup', () => { drag = null; });
    cv.addEventListener('mousemove', (ev) => {
      const rc = cv.getBoundingClientRect(), x = ev.clientX - rc.left, y = ev.clientY - rc.top;
      if (drag !== null && (ev.buttons & 1)) {
        const dt = (ev.clientX - drag) / p.plotW() * (p.t1 - p.t0);
        p.t0 -= dt; p.t1 -= dt; drag = ev.clientX; p.clamp(); refresh(p); return;
      }
      const hit = (p.spanRects || []).find((s) => x >= s.x0 && x <= s.x1 && y >= s.y && y < s.y + laneH);
      if (!hit) { tip.hidden = true; return; }
      tip.replaceChildren(el('b', '', hit.s.lane + ': ' + hit.s.name), el('div', '', ((hit.s.t1_ns - hit.s.t0_ns) / 1e6).toFixed(2) + ' ms' + (hit.s.peak_allocated_bytes ? ' · peak allocated ' + fmtB(hit.s.peak_allocated_bytes) : '')));
      tip.hidden = false;
      tip.style.left = (ev.clientX + 14) + 'px';
      tip.style.top = (ev.clientY + 14) + 'px';
    });
    cv.addEventListener('mouseleave', () => { tip.hidden = true; });
    return p;
  }

  // ---- page ----
  function active() { return panels.find((p) => p.sec.contains(document.activeElement)) || panels[0]; }
  document.addEventListener('keydown', (ev) => {
    if (ev.target && ev.target.tagName === 'INPUT') return;
    const p = active();
    if (!p) return;
    const mem = p.type === 'memory';
    const k = ev.key;
    if (k === '+' || k === '=') { if (mem) zoomX(p, 0.7); else { const c = (p.t0 + p.t1) / 2, h = (p.t1 - p.t0) * 0.35; p.t0 = c - h; p.t1 = c + h; p.clamp(); refresh(p); } }
    else if (k === '-' || k === '_') { if (mem) zoomX(p, 1 / 0.7); else { const c = (p.t0 + p.t1) / 2, h = (p.t1 - p.t0) / 1.4; p.t0 = c - h; p.t1 = c + h; p.clamp(); refresh(p); } }
    else if (k === 'ArrowLeft' || k === 'ArrowRight') {
      const d = (p.t1 - p.t0) * 0.1 * (k === 'ArrowLeft' ? -1 : 1);
      p.t0 += d; p.t1 += d; p.clamp(); if (mem) syncFrom(p); refresh(p);
    } else if (mem && (k === 'ArrowUp' || k === 'ArrowDown')) zoomY(p, k === 'ArrowUp' ? 0.7 : 1 / 0.7);
    else if (k === '0' || k === 'Home') { if (mem) p.full(); else { p.t0 = 0; p.t1 = p.m.end_ns; } if (mem) syncFrom(p); refresh(p); }
    else if (k === 'Escape' && mem) pin(p, null);
    else return;
    ev.preventDefault();
  });
  $('#zoom-in').addEventListener('click', () => { const p = active(); if (p && p.type === 'memory') zoomX(p, 0.5); });
  $('#zoom-out').addEventListener('click', () => { const p = active(); if (p && p.type === 'memory') zoomX(p, 2); });
  $('#reset').addEventListener('click', () => { for (const p of panels) { if (p.type === 'memory') p.full(); else { p.t0 = 0; p.t1 = p.m.end_ns; } refresh(p); } });
  $('#colour').addEventListener('change', (ev) => { colourBy = ev.target.value; panels.forEach((p) => { p.draw(); if (p.res && p.type === 'memory') updateLegend(p); }); });
  $('#search').addEventListener('keydown', async (ev) => {
    if (ev.key !== 'Enter') return;
    query = ev.target.value.trim();
    const box = $('#results');
    box.replaceChildren();
    searchHits = [];
    if (!query) { panels.forEach((p) => p.fetch()); return; }
    for (const p of panels) {
      if (p.type !== 'memory') continue;
      const r = await api('search', { doc: p.i, q: query });
      searchHits[p.i] = r.ids;
      p.sec.dataset.searchTotal = r.total;
      box.appendChild(el('div', 'count', p.m.name + ': ' + r.total + ' allocation(s) match ' + JSON.stringify(query)));
      for (const id of r.ids.slice(0, 30)) {
        const b = await blockDetail(p, id);
        const btn = el('button', 'hit', fmtB(b.size) + ' · ' + (b.site || '?') + ' · events ' + b.t0 + '→' + (b.t1 === null ? 'end' : b.t1));
        btn.type = 'button';
        btn.dataset.doc = p.i;
        btn.dataset.id = id;
        btn.addEventListener('click', async () => {
          await pin(p, id);
          const res = await api('lod', { doc: p.i, t0: b.t0, t1: (b.t1 === null ? p.m.events : b.t1), y0: 0, y1: p.m.y_max, cols: 100, rows: 100, pin: id });
          const band = res.bands.find((x) => x.id === id);
          zoomToBlock(p, band || b);
        });
        box.appendChild(btn);
      }
      p.fetch();
    }
  });

  async function start() {
    META = await api('meta', {});
    const root = $('#panels');
    const mems = META.docs.filter((d) => d.type === 'memory');
    if (META.docs.length > 1) {
      root.className = 'panels-diff';
      if (mems.length >= 2) {
        const [a, b] = mems;
        const d = b.peak_bytes - a.peak_bytes;
        const ia = META.docs.indexOf(a), ib = META.docs.indexOf(b);
        api('diff', { a: ia, b: ib }).then((r) => {
          if (!r) return;
          const t = el('table', 'difftable');
          const head = el('tr');
          for (const h of ['allocation site (at each trace\'s peak)', a.name, b.name, 'difference']) head.appendChild(el('th', '', h));
          t.appendChild(head);
          for (const row of r.rows) {
            const tr = el('tr');
            tr.appendChild(el('td', '', row.site));
            for (const v of [row.a_bytes, row.b_bytes]) tr.appendChild(el('td', 'num', fmtB(v)));
            tr.appendChild(el('td', 'num', (row.delta_bytes >= 0 ? '+' : '') + fmtB(row.delta_bytes)));
            t.appendChild(tr);
          }
          $('#diffbox').appendChild(t);
        });
        $('#summary').appendChild(el('div', 'diffsum', 'Diff: traced peak ' + fmtB(a.peak_bytes) + ' (' + a.name + ') vs ' + fmtB(b.peak_bytes) + ' (' + b.name + '): ' + (d >= 0 ? '+' : '') + fmtB(d) + '; ' + a.allocations + ' vs ' + b.allocations + ' allocations. Zoom and pan move both (same fraction of each trace).'));
      }
    }
    META.docs.forEach((m, i) => panels.push(m.type === 'memory' ? MemoryPanel(i, m, root) : ProfilePanel(i, m, root)));
    await Promise.all(panels.map((p) => { p.draw(); return p.fetch(); }));
    for (const p of panels) if (p.type === 'memory') { await showSegments(p, p.m.peak_event); await showIcicle(p); }
    document.body.dataset.ready = '1';
  }
  // Test and automation hooks (read-only views of the state).
  window.tmViewer = {
    panels,
    bandRect: (doc, id) => panels[doc].bandRect(id),
    view: (doc) => { const p = panels[doc]; return { t0: p.t0, t1: p.t1, y0: p.y0, y1: p.y1, pin: p.pin, bands: p.res ? p.res.bands.length : 0 }; },
  };
  window.addEventListener('resize', () => panels.forEach((p) => refresh(p)));
  start().catch((e) => { status('error: ' + e.message); document.body.dataset.error = e.message; });
})();
