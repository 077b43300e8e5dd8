/* polar-mitm dashboard: one page, routed on location.pathname, data from /api/ (JSON), live
   updates from /api/stream (server-sent events). Vanilla JS, no build step, nothing fetched
   from another host. */
'use strict';

(function () {
  const SESSION_STATES = ['pending', 'assigned', 'init', 'ready', 'run', 'post_run', 'done', 'timed_out',
    'failed', 'cancelled', 'lost', 'released'];
  const TASK_STATES = ['queued', 'running', 'done', 'cancelled'];
  const SVG = 'http://www.w3.org/2000/svg';

  // -- DOM helpers -------------------------------------------------------------------------------
  function add(el, kids) {
    for (const k of kids) {
      if (k === null || k === undefined || k === false) continue;
      if (Array.isArray(k)) add(el, k);
      else el.appendChild(k instanceof Node ? k : document.createTextNode(String(k)));
    }
    return el;
  }
  function attrs(el, a) {
    for (const [k, v] of Object.entries(a || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
      else if (k === 'class') el.setAttribute('class', v);
      else if (k === 'style' && typeof v === 'object') Object.assign(el.style, v);
      else el.setAttribute(k, v === true ? '' : String(v));
    }
    return el;
  }
  function h(tag, a, ...kids) { return add(attrs(document.createElement(tag), a), kids); }
  function s(tag, a, ...kids) { return add(attrs(document.createElementNS(SVG, tag), a), kids); }
  const enc = encodeURIComponent;
  const groupHref = (t) => '/groups/' + enc(t);
  const sessionHref = (sid) => '/sessions/' + enc(sid);

  // -- formats -----------------------------------------------------------------------------------
  const isNum = (x) => typeof x === 'number' && isFinite(x);
  function num(x, d) { return isNum(x) ? String(Number(x.toFixed(d === undefined ? 3 : d))) : ''; }
  function pm(mean, se) {
    if (!isNum(mean)) return '–';
    return num(mean) + (isNum(se) ? ' ± ' + num(se) : '');
  }
  function secs(x) { return isNum(x) ? (x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2)) : ''; }
  function ms(x) { return isNum(x) ? (x >= 1000 ? (x / 1000).toFixed(2) + ' s' : x.toFixed(0) + ' ms') : ''; }
  function int(x) { return isNum(x) ? x.toLocaleString('en-US') : ''; }
  function clock(iso) {
    if (!iso) return '';
    const d = new Date(iso);
    return isNaN(d) ? iso : d.toLocaleTimeString([], { hour12: false }) + '.' + String(d.getMilliseconds()).padStart(3, '0');
  }
  function versions(v) { return (v || []).length ? (v || []).map((x) => 'v' + x).join(' ') : ''; }
  function stateChips(byState, order, attr) {
    const keys = Object.keys(byState || {}).sort((a, b) => {
      const ia = order.indexOf(a), ib = order.indexOf(b);
      return (ia < 0 ? 99 : ia) - (ib < 0 ? 99 : ib) || a.localeCompare(b);
    });
    return h('span', { class: 'states' }, keys.map((k) =>
      h('span', { class: 'st count st-' + k, [attr || 'data-state']: k, 'data-count': byState[k] },
        h('b', null, String(byState[k])), ' ' + k)));
  }
  function stateChip(state) { return state ? h('span', { class: 'st st-' + state }, state) : h('span', { class: 'muted' }, '–'); }
  function shortDb(db, all) { return (all || []).length > 1 ? db.split('/').pop() : ''; }
  function baseName(path) { return String(path || '').split('/').pop(); }
  // a mean ± its standard error where one is wanted: "–" for an unknown se (one sample, or
  // an older loop's row that lacks what it takes)
  function pmSe(mean, se) { return isNum(mean) ? num(mean) + ' ± ' + (isNum(se) ? num(se) : '–') : '–'; }
  // text cut at a word boundary near `max` characters, with "…" (null when it fits)
  function cut(text, max) {
    const t = String(text || '');
    if (t.length <= max) return null;
    let end = t.lastIndexOf(' ', max);
    if (end < max * 0.6) end = max;
    return t.slice(0, end).replace(/[\s,;:.\-–—(]+$/, '') + '…';
  }
  // one line of a text: its whitespace collapsed
  const oneLine = (t) => String(t || '').replace(/\s+/g, ' ').trim();
  function tokensOf(calls) { return int((calls.prompt_tokens || 0)) + ' / ' + int(calls.completion_tokens || 0); }
  function details(summary, body, a) { return h('details', a || null, h('summary', null, summary), body); }
  // An output in a table row: none; a short one-line output inline; else folded, its summary
  // a one-line preview (the harness's from its start: the model's answer; the evaluator's
  // from its end: the score) and its size.
  const SHORT_OUTPUT = 80;
  function outBlock(cls, label, text, key, fromEnd) {
    const t = (text || '').replace(/\s+$/, '');
    if (!t.trim()) {
      return h('div', { class: 'out inline ' + cls }, h('span', { class: 'out-label' }, label), ' ',
        h('span', { class: 'muted' }, text === null || text === undefined ? 'none recorded' : '(empty)'));
    }
    if (t.length <= SHORT_OUTPUT && !t.includes('\n')) {
      return h('div', { class: 'out inline ' + cls }, h('span', { class: 'out-label' }, label), ' ', h('pre', null, t.trim()));
    }
    const lines = t.split('\n').filter((x) => x.trim());
    const preview = oneLine(fromEnd ? lines[lines.length - 1] : t);
    return details([h('span', { class: 'out-label' }, label),
      h('span', { class: 'muted size' }, ' (' + (lines.length > 1 ? lines.length + ' lines' : t.length + ' chars') + ') '),
      h('span', { class: 'preview', title: preview }, preview)],
    h('pre', null, t), { class: 'out ' + cls, 'data-key': cls + ':' + key });
  }

  // -- fetching -----------------------------------------------------------------------------------
  class NotFound extends Error {}
  async function getJSON(url) {
    const r = await fetch(url, { headers: { accept: 'application/json' }, cache: 'no-store' });
    const text = await r.text();
    let body = null;
    try { body = JSON.parse(text); } catch (e) { throw new Error(url + ': ' + r.status + ' ' + text.slice(0, 200)); }
    if (r.status === 404) throw new NotFound((body.error && body.error.message) || 'not found');
    if (!r.ok) throw new Error((body.error && body.error.message) || (url + ': HTTP ' + r.status));
    body.__text = text.replace(/^\{"generation":\d+,?/, '');
    return body;
  }

  // -- the pages ----------------------------------------------------------------------------------
  const pages = {};

  // Runs -----------------------------------------------------------------------------------------
  pages.runs = {
    title: 'Runs',
    load: () => getJSON('/api/runs'),
    render(d) {
      const out = [h('h1', null, 'Runs')];
      out.push(liveBox(d.live));
      for (const f of d.dbs) if (f.error) out.push(h('div', { class: 'error-box' }, f.db + ': ' + f.error));
      if (d.run) out.push(runInfo(d.run));
      const rows = [];
      for (const f of d.dbs) for (const run of f.runs) for (const it of run.iterations) rows.push({ db: f.db, it });
      const allDbs = d.dbs.map((f) => f.db);
      out.push(h('h2', null, 'Reward per iteration'));
      out.push(rewardChart(rows.map((r) => r.it)));
      out.push(h('h2', null, 'Iterations'));
      out.push(iterationsTable(rows, allDbs));
      const tasks = new Set();
      for (const r of rows) for (const t of Object.keys(r.it.per_task || {})) tasks.add(t);
      if (tasks.size) {
        out.push(h('h2', null, 'Reward per task'));
        out.push(perTaskTable(rows, [...tasks].sort()));
      }
      // each run's versions from the one its first iteration sampled at (the base weights,
      // never synced: v0) on
      const pvs = [];
      for (const f of d.dbs) {
        for (const run of f.runs) {
          const first = run.iterations.length ? run.iterations[0].policy_version : null;
          if (isNum(first) && !run.versions.some((v) => v.version <= first)) {
            pvs.push({ run_id: run.run_id, version: first, checkpoint: null, synced_at: null, base: true });
          }
          for (const v of run.versions) pvs.push(v);
        }
      }
      if (pvs.length) {
        out.push(h('h2', null, 'Policy versions'));
        out.push(h('table', { id: 'versions' },
          h('thead', null, h('tr', null, h('th', null, 'run'), h('th', { class: 'num' }, 'version'),
            h('th', null, 'checkpoint'), h('th', null, 'synced'))),
          h('tbody', null, pvs.map((v) => h('tr', { 'data-version': v.version },
            h('td', { class: 'mono' }, v.run_id), h('td', { class: 'num' }, 'v' + v.version),
            v.base ? h('td', { class: 'muted' }, 'the base weights (the run started from them)')
              : h('td', { class: 'mono' }, v.checkpoint || ''),
            h('td', null, (v.synced_at || '').replace('T', ' ').slice(0, 19)))))));
      }
      out.push(h('p', { class: 'muted dbs' }, d.dbs.map((f) =>
        h('span', null, h('span', { class: 'mono', title: f.db }, baseName(f.db)), ': ' + int(f.calls) + ' calls, '
          + int(f.sessions) + ' sessions. '))));
      return out;
    },
  };

  function liveBox(live) {
    // the iterations in progress, else the last one (a long loop's history is the table below)
    const all = live.iterations || [];
    const settled = (it) => Object.keys(it.tasks_by_state).every((k) => k === 'done' || k === 'cancelled')
      && Object.keys(it.sessions_by_state).every((k) => !['pending', 'assigned', 'init', 'ready', 'run', 'post_run'].includes(k));
    let its = all.filter((it) => !settled(it));
    if (!its.length && all.length) {
      const last = all[all.length - 1];
      its = all.filter((it) => it.run_id === last.run_id && it.iteration === last.iteration && it.db === last.db);
    }
    return h('section', { id: 'live' },
      h('div', { class: 'row' }, h('b', null, 'Now: '), 'tasks ',
        Object.keys(live.tasks_by_state).length ? stateChips(live.tasks_by_state, TASK_STATES, 'data-task-state')
          : h('span', { class: 'muted' }, 'none')),
      h('div', { class: 'row' }, 'sessions (each sample\'s current attempt) ',
        Object.keys(live.sessions_by_state).length ? stateChips(live.sessions_by_state, SESSION_STATES, 'data-state')
          : h('span', { class: 'muted' }, 'none'),
        h('span', { class: 'muted' }, '  ' + int(live.attempts) + ' attempts in all')),
      its.length ? h('table', { id: 'live-iterations' },
        h('thead', null, h('tr', null, h('th', null, 'run'), h('th', { class: 'num' }, 'iteration'), h('th', null, 'set'),
          h('th', { class: 'num' }, 'tasks'), h('th', null, 'sessions'), h('th', { class: 'num' }, 'reward so far'),
          h('th', null, ''))),
        h('tbody', null, its.map((it) => {
          const q = it.run_id !== null ? '?run=' + enc(it.run_id) + '&iteration=' + it.iteration + (it.held_out ? '&set=held-out' : '&set=train') : '';
          return h('tr', { 'data-live-iteration': it.iteration === null ? '' : it.iteration, 'data-run': it.run_id || '' },
            h('td', { class: 'mono' }, it.run_id || '(rollout)'), h('td', { class: 'num' }, it.iteration === null ? '' : it.iteration),
            h('td', null, it.held_out ? 'held-out' : 'train'), h('td', { class: 'num' }, it.tasks),
            h('td', null, stateChips(it.sessions_by_state, SESSION_STATES, 'data-session-state')),
            h('td', { class: 'num' }, isNum(it.reward_mean) ? num(it.reward_mean) + ' (n=' + it.rewarded + ')' : ''),
            h('td', null, h('a', { href: '/groups' + q }, 'groups')));
        }))) : null);
  }

  function runInfo(run) {
    const loop = run.loop || {};
    return h('div', { class: 'meta' },
      h('span', null, h('b', null, 'run dir '), h('code', null, run.dir)),
      loop.run_id ? h('span', null, h('b', null, 'run '), h('code', null, loop.run_id)) : null,
      isNum(loop.completed) ? h('span', null, h('b', null, 'completed '), loop.completed + ' iterations') : null,
      isNum(loop.version) ? h('span', null, h('b', null, 'serving '), 'v' + loop.version) : null,
      run.checkpoints.length ? h('span', null, h('b', null, 'checkpoints '), run.checkpoints.join(' ')) : null,
      run.error ? h('span', { class: 'muted' }, run.error) : null);
  }

  function timeBar(it) {
    const parts = [['rollout', it.rollout_s], ['train', it.train_s], ['sync', it.sync_s]];
    const total = parts.reduce((a, [, v]) => a + (isNum(v) ? v : 0), 0);
    return h('span', { title: parts.map(([k, v]) => k + ' ' + secs(v) + ' s').join(', ') },
      h('span', { class: 'bar' }, total > 0 ? parts.map(([k, v]) =>
        h('span', { class: k, style: { width: (100 * (isNum(v) ? v : 0) / total) + '%' } })) : null),
      parts.map(([, v]) => secs(v)).join(' / '));
  }

  function iterationsTable(rows, allDbs) {
    const runs = new Set(rows.map((r) => r.it.run_id));
    const multi = runs.size > 1 || allDbs.length > 1;
    const head = ['iteration', 'policy', 'reward ± se', 'held-out ± se', 'sessions', 'stale dropped', 'calls',
      'tokens', 'loss', 'rollout / train / sync s', ''];
    return h('table', { id: 'iterations' },
      h('thead', null, h('tr', null, multi ? h('th', null, 'run') : null,
        head.map((x, i) => h('th', { class: [0, 1, 5, 6, 7, 8].includes(i) ? 'num' : null }, x)))),
      h('tbody', null, rows.length ? rows.map(({ db, it }) => {
        const sess = { done: it.sessions_done, failed: it.sessions_failed, timed_out: it.sessions_timed_out,
          released: it.sessions_released };
        for (const k of Object.keys(sess)) if (!sess[k]) delete sess[k];
        const q = '?run=' + enc(it.run_id) + '&iteration=' + it.iteration;
        return h('tr', { 'data-iteration': it.iteration, 'data-run': it.run_id, 'data-db': db },
          multi ? h('td', { class: 'mono' }, it.run_id + (allDbs.length > 1 ? ' (' + shortDb(db, allDbs) + ')' : '')) : null,
          h('td', { class: 'num' }, it.iteration),
          h('td', { class: 'num' }, 'v' + it.policy_version),
          h('td', { class: 'num reward', title: nFrom(it.reward_n_from) }, pmSe(it.reward_mean, it.reward_se),
            isNum(it.reward_n) ? h('span', { class: 'muted' }, ' n=' + it.reward_n) : null),
          h('td', { class: 'num held-out', title: nFrom(it.eval_reward_n_from) }, pmSe(it.eval_reward_mean, it.eval_reward_se),
            isNum(it.eval_reward_n) ? h('span', { class: 'muted' }, ' n=' + it.eval_reward_n) : null),
          h('td', { class: 'sessions' }, stateChips(sess, SESSION_STATES, 'data-session-state')),
          h('td', { class: 'num stale' }, int(it.stale_dropped)),
          h('td', { class: 'num' }, int(it.calls)),
          h('td', { class: 'num' }, int(it.tokens)),
          h('td', { class: 'num' }, isNum(it.loss) ? it.loss.toFixed(4) : ''),
          h('td', { class: 'time' }, timeBar(it)),
          h('td', null, h('a', { href: '/groups' + q }, 'groups')));
      }) : h('tr', null, h('td', { colspan: head.length + 1, class: 'muted' },
        'No loop iterations in these files (a rollout without polar-train loop, or its first iteration is still running).'))));
  }

  function nFrom(from) {
    return { per_task: 'n: the rewarded sessions per task (this row predates reward_n)',
      sessions_done: 'n: the sessions done (this row predates reward_n)',
      sessions: 'std and n: the held-out sessions of this iteration (this row predates eval_reward_std)' }[from] || null;
  }

  function perTaskTable(rows, tasks) {
    return h('table', { id: 'per-task' },
      h('thead', null,
        h('tr', null, h('th', { rowspan: 2 }, 'task'), h('th', { class: 'group-head', colspan: rows.length }, 'iteration')),
        h('tr', null, rows.map(({ it }) => h('th', { class: 'num', title: 'iteration ' + it.iteration + ' (policy v' + it.policy_version + ')' },
          String(it.iteration))))),
      h('tbody', null, tasks.map((t) => h('tr', { 'data-task': t }, h('td', { class: 'mono' }, t),
        rows.map(({ it }) => {
          const x = (it.per_task || {})[t];
          return h('td', { class: 'num', title: x ? 'std ' + num(x.std) + ', n=' + x.n : '' }, x ? num(x.mean) : '');
        })))));
  }

  function rewardChart(its) {
    const W = 660, H = 230, L = 44, R = 140, T = 12, B = 32;
    const svg = s('svg', { id: 'reward-chart', class: 'chart', width: W, height: H, viewBox: `0 0 ${W} ${H}`,
      role: 'img', 'aria-label': 'reward per iteration' });
    if (!its.length) {
      svg.appendChild(s('text', { x: W / 2, y: H / 2, 'text-anchor': 'middle', class: 'muted' }, 'no iterations yet'));
      return svg;
    }
    const series = [
      { key: 'train', label: 'training tasks', color: '#2f6fcf', pts: its.filter((i) => isNum(i.reward_mean)).map((i) => [i.iteration, i.reward_mean, i.reward_se]) },
      { key: 'held-out', label: 'held-out tasks', color: '#d9822b', dash: '5 3', pts: its.filter((i) => isNum(i.eval_reward_mean)).map((i) => [i.iteration, i.eval_reward_mean, i.eval_reward_se]) },
    ];
    const xs = its.map((i) => i.iteration);
    const x0 = Math.min(...xs), x1 = Math.max(...xs);
    let y0 = 0, y1 = 1;
    for (const sr of series) for (const [, m, se] of sr.pts) { y0 = Math.min(y0, m - (se || 0)); y1 = Math.max(y1, m + (se || 0)); }
    const P = 12;    // the first and last points clear of the axes (their error bars too)
    const X = (x) => L + P + (x1 === x0 ? (W - L - R - 2 * P) / 2 : (x - x0) / (x1 - x0) * (W - L - R - 2 * P));
    const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    const ticks = 5;
    for (let k = 0; k <= ticks; k++) {
      const y = y0 + (y1 - y0) * k / ticks;
      svg.appendChild(s('line', { class: 'grid', x1: L, x2: W - R, y1: Y(y), y2: Y(y) }));
      svg.appendChild(s('text', { x: L - 6, y: Y(y) + 4, 'text-anchor': 'end' }, num(y, 2)));
    }
    svg.appendChild(s('line', { class: 'axis', x1: L, x2: W - R, y1: H - B, y2: H - B }));
    svg.appendChild(s('line', { class: 'axis', x1: L, x2: L, y1: T, y2: H - B }));
    const step = Math.max(1, Math.ceil((x1 - x0 + 1) / 12));
    for (let x = x0; x <= x1; x += step) svg.appendChild(s('text', { x: X(x), y: H - B + 14, 'text-anchor': 'middle' }, String(x)));
    svg.appendChild(s('text', { x: (L + W - R) / 2, y: H - 4, 'text-anchor': 'middle' }, 'iteration'));
    let bars = 0;
    series.forEach((sr, n) => {
      if (!sr.pts.length) return;
      const g = s('g', { 'data-series': sr.key });
      g.appendChild(s('polyline', { fill: 'none', stroke: sr.color, 'stroke-width': 1.6, 'stroke-dasharray': sr.dash || null,
        points: sr.pts.map(([x, m]) => X(x) + ',' + Y(m)).join(' ') }));
      for (const [x, m, se] of sr.pts) {
        if (isNum(se)) {
          bars += 1;
          g.appendChild(s('line', { stroke: sr.color, x1: X(x), x2: X(x), y1: Y(m - se), y2: Y(m + se) }));
          g.appendChild(s('line', { stroke: sr.color, x1: X(x) - 3, x2: X(x) + 3, y1: Y(m - se), y2: Y(m - se) }));
          g.appendChild(s('line', { stroke: sr.color, x1: X(x) - 3, x2: X(x) + 3, y1: Y(m + se), y2: Y(m + se) }));
        }
        const dot = n === 0 ? s('circle', { cx: X(x), cy: Y(m), r: 3.2, fill: sr.color })
          : s('rect', { x: X(x) - 3, y: Y(m) - 3, width: 6, height: 6, fill: sr.color });
        dot.appendChild(s('title', null, `${sr.label}, iteration ${x}: ${pm(m, se)}`));
        g.appendChild(dot);
      }
      svg.appendChild(g);
      svg.appendChild(s('line', { x1: W - R + 12, x2: W - R + 32, y1: T + 10 + n * 16, y2: T + 10 + n * 16, stroke: sr.color,
        'stroke-width': 2, 'stroke-dasharray': sr.dash || null }));
      svg.appendChild(s('text', { x: W - R + 36, y: T + 14 + n * 16 }, sr.label));
    });
    if (bars) {
      // the legend's error bar: drawn as the points' are
      const lx = W - R + 22, ly = T + 46;
      svg.appendChild(s('line', { stroke: '#555', x1: lx, x2: lx, y1: ly - 6, y2: ly + 6 }));
      svg.appendChild(s('line', { stroke: '#555', x1: lx - 3, x2: lx + 3, y1: ly - 6, y2: ly - 6 }));
      svg.appendChild(s('line', { stroke: '#555', x1: lx - 3, x2: lx + 3, y1: ly + 6, y2: ly + 6 }));
      svg.appendChild(s('text', { x: W - R + 36, y: ly + 4 }, '± standard error'));
    }
    return svg;
  }

  // Groups ---------------------------------------------------------------------------------------
  const groupsFilter = { q: '' };
  pages.groups = {
    title: 'Groups',
    load: () => getJSON('/api/groups'),
    render(d) {
      const params = new URLSearchParams(location.search);
      const run = params.get('run'), iteration = params.get('iteration'), set = params.get('set');
      const q = groupsFilter.q.toLowerCase();
      const rows = d.groups.filter((g) => (run === null || g.run_id === run)
        && (iteration === null || String(g.iteration) === iteration)
        && (set === null || (set === 'held-out') === g.held_out)
        && (!q || g.task_id.toLowerCase().includes(q) || (g.instruction || '').toLowerCase().includes(q)));
      const allDbs = [...new Set(d.groups.map((g) => g.db))];
      const filters = [run !== null ? 'run ' + run : null, iteration !== null ? 'iteration ' + iteration : null,
        set !== null ? set : null].filter(Boolean);
      const search = h('input', { type: 'search', placeholder: 'filter tasks', value: groupsFilter.q, 'data-keep': 'groups-q',
        oninput: (ev) => { groupsFilter.q = ev.target.value; rerender(); } });
      return [
        h('h1', null, 'Groups'),
        h('div', { class: 'toolbar' }, search,
          filters.length ? h('span', null, 'showing ' + filters.join(', ') + ' · ', h('a', { href: '/groups' }, 'all groups')) : null,
          h('span', { class: 'muted' }, rows.length + ' of ' + d.groups.length + ' tasks')),
        (d.errors || []).map((e) => h('div', { class: 'error-box' }, e.db + ': ' + e.error)),
        h('table', { id: 'groups' },
          h('thead', null, h('tr', null, ['task', 'base task', 'run', 'iteration', 'set', 'task state', 'samples',
            'sessions', 'rewarded', 'reward ± se', 'std', 'min – max', 'calls', 'tokens (prompt / sampled)', 'policy',
            allDbs.length > 1 ? 'db' : null].filter((x) => x !== null).map((x) => h('th', null, x)))),
          h('tbody', null, rows.map((g) => h('tr', { 'data-task': g.task_id, 'data-db': g.db },
            h('td', { class: 'mono id' }, h('a', { href: groupHref(g.task_id) }, g.task_id)),
            h('td', { class: 'mono id' }, g.base_task !== g.task_id ? h('a', { href: '/compare?task=' + enc(g.base_task), title: 'this task across policy versions' }, g.base_task) : ''),
            h('td', { class: 'mono' }, g.run_id || ''),
            h('td', { class: 'num' }, g.iteration === null ? '' : g.iteration),
            h('td', null, g.run_id ? (g.held_out ? 'held-out' : 'train') : ''),
            h('td', null, stateChip(g.state)),
            h('td', { class: 'num' }, g.samples === null ? '' : g.samples),
            h('td', null, stateChips(g.by_state, SESSION_STATES, 'data-state'),
              g.sessions > Object.values(g.by_state).reduce((a, b) => a + b, 0) && Object.keys(g.by_state).length
                ? h('span', { class: 'muted', title: 'attempts, retries included' }, ' ' + g.sessions + ' attempts') : null),
            h('td', { class: 'num' }, g.rewarded),
            h('td', { class: 'num' }, pm(g.reward_mean, g.reward_se)),
            h('td', { class: 'num' }, num(g.reward_std)),
            h('td', { class: 'num' }, isNum(g.reward_min) ? num(g.reward_min) + ' – ' + num(g.reward_max) : ''),
            h('td', { class: 'num' }, int(g.calls.calls)),
            h('td', { class: 'num' }, tokensOf(g.calls)),
            h('td', null, versions(g.calls.versions)),
            allDbs.length > 1 ? h('td', { class: 'mono' }, shortDb(g.db, allDbs)) : null)))),
      ];
    },
  };

  // Group ----------------------------------------------------------------------------------------
  pages.group = {
    title: 'Group',
    arg: () => decodeURIComponent(location.pathname.slice('/groups/'.length)),
    load() { return getJSON('/api/groups/' + enc(this.arg())); },
    render(d) {
      const spec = d.spec || {};
      const q = d.run_id !== null ? '?run=' + enc(d.run_id) + '&iteration=' + d.iteration : '';
      const current = d.samples.filter((x) => x.current);
      const first = current[0];
      return [
        h('div', { class: 'muted' }, h('a', { href: '/groups' }, 'groups'),
          d.run_id !== null ? [' › ', h('a', { href: '/groups' + q }, 'run ' + d.run_id + ' iteration ' + d.iteration)] : null),
        h('h1', null, 'Group ', h('code', null, d.task_id)),
        h('div', { class: 'meta' },
          h('span', null, h('b', null, 'state '), stateChip(d.state)),
          h('span', null, h('b', null, 'samples '), String(spec.num_samples || current.length)),
          h('span', null, h('b', null, 'reward '), pm(d.reward.mean, d.reward.se), ' (n=' + d.reward.n + ', std ' + num(d.reward.std) + ')'),
          d.run_id !== null ? h('span', null, h('b', null, 'set '), d.held_out ? 'held-out' : 'train') : null,
          spec.harness ? h('span', null, h('b', null, 'harness '), spec.harness) : null,
          h('span', null, h('a', { href: '/compare?task=' + enc(d.base_task) }, d.base_task + ' across policy versions')),
          first && current.length > 1 ? h('span', null, h('a', { href: '/compare?a=' + enc(current[0].session_id) + '&b=' + enc(current[1].session_id) }, 'compare two samples')) : null),
        spec.instruction ? h('div', null, h('b', null, 'instruction'), h('pre', { class: 'instruction' }, spec.instruction)) : null,
        details('task spec', h('pre', null, JSON.stringify(spec, null, 2)), { 'data-key': 'spec' }),
        h('h2', null, 'Samples'),
        h('table', { id: 'samples' },
          h('thead', null, h('tr', null, ['session', 'sample', 'attempt', 'state', 'reward', 'reason', 'calls',
            ['tokens', h('div', { class: 'sub' }, 'prompt / sampled')], 'policy', 'history', 'outputs', ''].map((x) => h('th', null, x)))),
          h('tbody', null, d.samples.map((x) => {
            const others = current.filter((y) => y.session_id !== x.session_id);
            return h('tr', { 'data-session': x.session_id, 'data-db': x.db, class: x.current ? null : 'superseded' },
              h('td', { class: 'mono id' }, h('a', { href: sessionHref(x.session_id) }, x.session_id)),
              h('td', { class: 'num' }, x.sample === null ? '' : x.sample),
              h('td', { class: 'num' }, x.attempt),
              h('td', null, stateChip(x.state)),
              h('td', { class: 'num reward' }, isNum(x.reward) ? num(x.reward) : '–'),
              h('td', null, x.reason ? h('span', { class: 'bad' }, x.reason) : (isNum(x.exit_code) && x.exit_code !== 0 ? 'exit ' + x.exit_code : '')),
              h('td', { class: 'num' }, int(x.calls.calls) + (x.calls.failed_calls ? ' (' + x.calls.failed_calls + ' failed)' : '')),
              h('td', { class: 'num' }, tokensOf(x.calls)),
              h('td', null, versions(x.calls.versions)),
              h('td', { class: 'history' }, x.events.length ? details(x.events.length + ' events',
                h('ol', { class: 'events' }, x.events.map((e) => h('li', null, clock(e.at) + ' ', stateChip(e.state),
                  e.node_id ? h('span', { class: 'muted' }, ' ' + e.node_id) : null, e.detail ? ' ' + e.detail : null))),
              { 'data-key': 'ev:' + x.session_id }) : ''),
              h('td', { class: 'outputs-cell' }, outBlock('harness-output', 'harness', x.harness_output, x.session_id),
                outBlock('eval-output', 'evaluator', x.eval_output, x.session_id, true)),
              h('td', null, others.length ? h('a', { href: '/compare?a=' + enc(x.session_id) + '&b=' + enc(others[0].session_id) }, 'compare') : ''));
          }))),
        d.events.length ? details('task events (' + d.events.length + ')', h('ol', null, d.events.map((e) =>
          h('li', null, clock(e.at) + ' ', stateChip(e.state), e.detail ? ' ' + e.detail : null))), { 'data-key': 'task-events' }) : null,
      ];
    },
  };

  // Session --------------------------------------------------------------------------------------
  pages.session = {
    title: 'Session',
    arg: () => decodeURIComponent(location.pathname.slice('/sessions/'.length)),
    load() { return getJSON('/api/sessions/' + enc(this.arg())); },
    render(d) { return sessionView(d, true); },
  };

  function lpColor(lp) {
    if (!isNum(lp)) return '#eef1f4';
    const p = Math.exp(Math.max(lp, -20));
    return 'hsl(' + Math.round(120 * p) + ', 75%, ' + Math.round(82 + 8 * p) + '%)';
  }

  function tokenSpans(call, driftFrom) {
    const LIMIT = 4000;        // per call; the rest is counted
    const toks = call.tokens;
    const spans = [];
    const n = Math.min(toks.length, LIMIT);
    for (let i = 0; i < n; i++) {
      const [id, text, lp] = toks[i];
      const drift = driftFrom.some(([at, len]) => i >= at && i < at + len);
      const shown = text === null || text === undefined ? '⟨' + id + '⟩' : text.replace(/\n/g, '↵\n');
      spans.push(h('span', {
        class: 'tok' + (drift ? ' drift' : ''), 'data-id': id, 'data-logprob': lp === null ? null : lp,
        style: { background: lpColor(lp) },
        title: 'id ' + id + (isNum(lp) ? ' · logprob ' + lp.toFixed(4) + ' · p ' + Math.exp(lp).toFixed(3) : ' · no logprob')
          + (drift ? ' · re-rendered differently in a later prompt' : ''),
      }, shown));
    }
    if (toks.length > LIMIT) spans.push(h('span', { class: 'muted' }, ' … ' + (toks.length - LIMIT) + ' more tokens'));
    return h('div', { class: 'tokens' }, spans);
  }

  function turnView(t, ids) {
    const role = t.role;
    const head = h('span', { class: 'role' }, role + (role === 'tool' && t.name ? ' · ' + t.name : ''));
    if (role === 'system') {
      return h('li', { class: 'turn', 'data-role': 'system' },
        details(['system prompt ', h('span', { class: 'muted' }, '(' + t.text.length + ' chars)')],
          h('pre', { class: 'text' }, t.text), { 'data-key': 'system' }));
    }
    const kids = [head];
    if (role === 'assistant' && isNum(t.call_seq)) {
      kids.push(ids ? h('a', { class: 'call-ref', href: '#call-' + t.call_seq }, 'call ' + t.call_seq)
        : h('span', { class: 'call-ref muted' }, 'call ' + t.call_seq));
    }
    if (t.reasoning) kids.push(details('reasoning', h('pre', null, t.reasoning), { 'data-key': 'reasoning' }));
    if (t.text) kids.push(h('pre', { class: 'text' }, t.text));
    for (const c of t.tool_calls || []) {
      let args = c.arguments;
      try { args = JSON.stringify(JSON.parse(c.arguments), null, 1); } catch (e) { /* not JSON: as sent */ }
      kids.push(h('div', { class: 'tool-call', 'data-tool': c.name },
        h('span', { class: 'name' }, c.name), c.id ? h('span', { class: 'muted' }, ' ' + c.id) : null,
        h('pre', { class: 'arguments', title: c.arguments }, args)));
    }
    if (!t.text && !(t.tool_calls || []).length && !t.reasoning) kids.push(h('span', { class: 'muted' }, '(empty)'));
    return h('li', { class: 'turn' + (t.is_error ? ' is-error' : ''), 'data-role': role }, kids);
  }

  function toolDescription(text) {
    const short = cut(text, 170);
    if (short === null) return h('span', { class: 'muted description' }, text);
    const span = h('span', { class: 'muted description', title: text }, short, ' ');
    span.appendChild(h('button', { type: 'button', class: 'link more', onclick: () => span.replaceChildren(text) }, 'more'));
    return span;
  }

  function sessionView(d, ids) {
    const id = (x) => (ids ? x : null);
    const drift = d.drift || [];
    const siblings = d.siblings || [];
    const models = [...new Set(d.calls.map((c) => c.served_model && c.served_model !== c.requested_model
      ? (c.requested_model || '') + ' → ' + c.served_model : c.requested_model || c.served_model).filter(Boolean))];
    const out = [];
    out.push(h('div', { class: 'muted' }, h('a', { href: '/groups' }, 'groups'),
      d.task_id ? [' › ', h('a', { href: groupHref(d.task_id) }, d.task_id)] : null));
    out.push(h(ids ? 'h1' : 'h2', { class: 'session-id' }, 'Session ', h('code', null, d.session_id)));
    out.push(h('div', { class: 'meta' },
      h('span', null, h('b', null, 'state '), stateChip(d.state)),
      h('span', null, h('b', null, 'reward '), isNum(d.reward) ? num(d.reward) : '–'),
      d.reason ? h('span', { class: 'bad' }, d.reason) : null,
      d.attempt ? h('span', null, h('b', null, 'attempt '), String(d.attempt)) : null,
      d.node_id ? h('span', null, h('b', null, 'node '), d.node_id) : null,
      h('span', null, h('b', null, 'calls '), String(d.calls.length)),
      !ids && models.length ? h('span', { class: 'model', title: models.join(', ') }, h('b', null, 'model '), models.join(', ')) : null,
      (d.open_dbs || d.dbs.length) > 1 ? h('span', { class: 'mono muted', title: d.db }, baseName(d.db)) : null));
    if (ids && (siblings.length || d.base_task)) {
      out.push(h('div', { class: 'meta' }, siblings.length ? [h('b', null, 'compare with '),
        siblings.slice(0, 16).map((sib) => h('a', { class: 'pill', href: '/compare?a=' + enc(d.session_id) + '&b=' + enc(sib) }, sib))] : null,
        d.base_task ? h('a', { href: '/compare?task=' + enc(d.base_task) }, d.base_task + ' across policy versions') : null));
    }
    if (d.instruction) out.push(details('instruction', h('pre', null, d.instruction), { 'data-key': 'instruction' }));
    // the conversation
    out.push(h('h2', null, 'Conversation',
      isNum(d.conversation_call) ? h('span', { class: 'muted' }, ' (as the model saw it at call ' + d.conversation_call + ', with its answer)') : null));
    if (!d.turns.length) out.push(h('p', { class: 'muted' }, 'No conversation could be read from the recorded calls.'));
    out.push(h('ol', { id: id('turns'), class: 'turns' }, d.turns.map((t) => turnView(t, ids))));
    if (d.tools.length) {
      out.push(details('tools offered (' + d.tools.length + ')', h('ul', { class: 'tools' }, d.tools.map((t) =>
        h('li', { 'data-tool-def': t.name }, h('code', null, t.name), ' ', toolDescription(t.description || ''),
          details('parameters', h('pre', null, JSON.stringify(t.parameters, null, 1)), { 'data-key': 'tp:' + t.name })))),
      { 'data-key': 'tools' }));
    }
    // the calls
    out.push(h('h2', null, 'Calls'),
      h('div', { class: 'legend' }, 'sampled tokens by logprob: ',
        [-8, -4, -2, -1, -0.5, -0.1, 0].map((lp) => h('span', { class: 'tok', style: { background: lpColor(lp) } }, String(lp))),
        drift.length ? h('span', { class: 'tok drift' }, 're-rendered (drift)') : null));
    let budget = 20000;        // token spans drawn at once; later calls draw theirs on request
    const callParts = (c) => {
      const from = drift.filter((x) => x.call_seq === c.seq).map((x) => [x.at, x.tokens]);
      return {
        policy: h('td', { class: 'num policy' }, c.policy_version === null ? h('span', { class: 'warn', title: 'unknown: never trained' }, '?') : 'v' + c.policy_version),
        latency: h('td', { class: 'num latency' }, ms(c.latency.total_ms), h('div', { class: 'muted' }, ms(c.latency.backend_ms) + (isNum(c.latency.queue_ms) ? ', ' + ms(c.latency.queue_ms) : ''))),
        error: c.error ? h('span', { class: 'bad', title: c.error }, (c.error_kind || 'error') + ': ' + c.error.slice(0, 160)) : null,
        notes: c.drift.map((x) => h('div', { class: 'drift', 'data-drift-call': x.call_seq, 'data-drift-later': x.later_seq },
          x.later_seq === c.seq ? 'prompt re-renders call ' + x.call_seq + ' from token ' + x.at
            : 're-rendered by call ' + x.later_seq + ' from token ' + x.at, ' (' + x.tokens + ' tokens)')),
        tokens: !c.tokens.length ? h('span', { class: 'muted' }, 'no sampled tokens')
          : (budget -= c.tokens.length) >= 0 ? tokenSpans(c, from)
            : h('button', { type: 'button', class: 'show-tokens', onclick: (ev) => ev.target.replaceWith(tokenSpans(c, from)) },
              'show its ' + c.tokens.length + ' sampled tokens'),
      };
    };
    const modelOf = (c) => (c.requested_model || '') + (c.served_model && c.served_model !== c.requested_model ? ' → ' + c.served_model : '');
    if (ids) {
      out.push(h('table', { id: 'calls', class: 'calls' },
        h('thead', null, h('tr', null, ['call', 'model', 'policy', 'latency (backend, queue)', 'finish', 'prompt',
          'sampled', 'error', 'drift', 'sampled tokens'].map((x) => h('th', null, x)))),
        h('tbody', null, d.calls.map((c) => {
          const p = callParts(c);
          return h('tr', { 'data-call': c.seq, id: 'call-' + c.seq },
            h('td', { class: 'num' }, String(c.seq)),
            h('td', { class: 'mono model', title: modelOf(c) }, c.requested_model || '',
              c.served_model && c.served_model !== c.requested_model ? h('div', { class: 'muted' }, '→ ' + c.served_model) : null),
            p.policy, p.latency,
            h('td', { class: 'finish' }, c.finish_reason || ''),
            h('td', { class: 'num' }, int(c.prompt_len)),
            h('td', { class: 'num' }, int(c.completion_tokens), c.logprobs_aligned ? null : h('div', { class: 'warn' }, 'logprobs misaligned')),
            h('td', null, p.error || ''),
            h('td', null, p.notes),
            h('td', { class: 'sampled-tokens' }, p.tokens));
        }))));
    } else {
      // a compare column: each call's figures on one line, its sampled tokens under it, the
      // column's whole width (the model is in the header above)
      out.push(h('table', { class: 'calls compact' },
        h('thead', null, h('tr', null, h('th', { class: 'num' }, 'call'), h('th', { class: 'num' }, 'policy'),
          h('th', { class: 'num' }, 'latency (backend, queue)'), h('th', null, 'finish'), h('th', { class: 'num' }, 'prompt'),
          h('th', { class: 'num' }, 'sampled'))),
        d.calls.map((c) => {
          const p = callParts(c);
          return h('tbody', { 'data-call-group': c.seq },
            h('tr', { 'data-call': c.seq },
              h('td', { class: 'num' }, String(c.seq)), p.policy, p.latency,
              h('td', { class: 'finish' }, c.finish_reason || ''),
              h('td', { class: 'num' }, int(c.prompt_len)),
              h('td', { class: 'num' }, int(c.completion_tokens), c.logprobs_aligned ? null : h('div', { class: 'warn' }, 'logprobs misaligned'))),
            h('tr', { class: 'call-tokens', 'data-call-tokens': c.seq },
              h('td', { colspan: 6, class: 'sampled-tokens' }, p.error ? h('div', null, p.error) : null, p.notes, p.tokens)));
        })));
    }
    if (drift.length) {
      out.push(h('h2', null, 'Drift'), drift.map((x) => h('div', { class: 'drift' },
        'Call ' + x.later_seq + '\'s prompt re-renders call ' + x.call_seq + '\'s sampled tokens differently from token '
        + x.at + ' on (' + x.tokens + ' tokens): the harness rewrote its history there.')));
    }
    out.push(h('h2', null, 'Outputs'), h('div', { class: 'outputs' },
      h('div', null, h('b', null, 'harness (stdout and stderr, tail)'), d.harness_output === null ? h('span', { class: 'muted' }, ' none recorded') : null,
        h('pre', { id: id('harness-output'), class: 'harness-output' }, d.harness_output || '')),
      h('div', null, h('b', null, 'evaluator (tail)'), d.eval_output === null ? h('span', { class: 'muted' }, ' none recorded') : null,
        h('pre', { id: id('eval-output'), class: 'eval-output' }, d.eval_output || ''))));
    if (d.reward_info) out.push(details('reward info', h('pre', null, JSON.stringify(d.reward_info, null, 2)), { 'data-key': 'reward-info' }));
    if (d.stats) out.push(details('session stats', h('pre', null, JSON.stringify(d.stats, null, 2)), { 'data-key': 'stats' }));
    return out;
  }

  // Compare --------------------------------------------------------------------------------------
  const compareState = { va: null, vb: null, a: null, b: null };
  pages.compare = {
    title: 'Compare',
    async load() {
      const p = new URLSearchParams(location.search);
      const task = p.get('task');
      let a = p.get('a'), b = p.get('b');
      let versionsData = null;
      if (task) {
        versionsData = await getJSON('/api/compare?task=' + enc(task));
        const vs = versionsData.versions;
        if (vs.length) {
          const pick = (v) => { const x = vs.find((y) => String(y.policy_version) === String(v)); return x; };
          const va = pick(compareState.va ?? p.get('va')) || vs[0];
          const vb = pick(compareState.vb ?? p.get('vb')) || vs[vs.length - 1];
          compareState.va = va.policy_version; compareState.vb = vb.policy_version;
          // each side's default: its version's best-rewarded session (ties: the fewest calls,
          // then the first); a superseded attempt only when nothing else is there
          const firstOf = (v, except) => {
            let best = null;
            const key = (x) => [x.current ? 1 : 0, isNum(x.reward) ? 1 : 0, isNum(x.reward) ? x.reward : 0, -((x.calls || {}).calls || 0)];
            for (const x of v.sessions) {
              if (x.session_id === except) continue;
              if (best === null) { best = x; continue; }
              const kx = key(x), kb = key(best);
              const i = kx.findIndex((y, j) => y !== kb[j]);
              if (i >= 0 && kx[i] > kb[i]) best = x;
            }
            return best ? best.session_id : null;
          };
          a = compareState.a && va.sessions.some((x) => x.session_id === compareState.a) ? compareState.a : (a && va.sessions.some((x) => x.session_id === a) ? a : firstOf(va));
          b = compareState.b && vb.sessions.some((x) => x.session_id === compareState.b) ? compareState.b : (b && vb.sessions.some((x) => x.session_id === b) ? b : firstOf(vb));
          if (va === vb && a === b) b = firstOf(vb, a) || b;
          compareState.a = a; compareState.b = b;
        }
      }
      let pair = null;
      if (a && b) pair = await getJSON('/api/compare?a=' + enc(a) + '&b=' + enc(b));
      const gens = [versionsData, pair].filter(Boolean).map((x) => x.generation);
      if (!gens.length) gens.push((await getJSON('/api/info')).generation);
      return { generation: gens.length ? Math.min(...gens) : 0, task, versions: versionsData, pair,
        __text: (versionsData ? versionsData.__text : '') + '|' + (pair ? pair.__text : '') };
    },
    render(d) {
      const out = [h('h1', null, 'Compare')];
      if (d.task && d.versions) out.push(versionPicker(d.versions));
      if (!d.pair) {
        if (!d.task) {
          out.push(h('p', null, 'Two sessions side by side: ', h('code', null, '/compare?a=SESSION&b=SESSION'),
            ', or a task at two policy versions: ', h('code', null, '/compare?task=TASK'), '. Or from a group\'s page.'));
          const ia = h('input', { type: 'text', name: 'a', placeholder: 'session a' });
          const ib = h('input', { type: 'text', name: 'b', placeholder: 'session b' });
          const it = h('input', { type: 'text', name: 'task', placeholder: 'or a base task' });
          out.push(h('form', { class: 'toolbar', method: 'get', action: '/compare' }, ia, ib, it, h('button', { type: 'submit' }, 'compare')));
        } else {
          out.push(h('p', { class: 'muted' }, 'No two sessions of ' + d.task + ' to compare yet.'));
        }
        return out;
      }
      out.push(h('div', { class: 'compare-grid' },
        [d.pair.a, d.pair.b].map((x, i) => h('div', { class: 'compare-col', 'data-side': i ? 'b' : 'a', 'data-session': x.session_id },
          sessionView(x, false)))));
      return out;
    },
  };

  function versionPicker(v) {
    const vs = v.versions;
    const table = h('table', { id: 'versions' },
      h('thead', null, h('tr', null, ['policy', 'sessions', 'reward ± se', 'iterations'].map((x) => h('th', null, x)))),
      h('tbody', null, vs.map((x) => h('tr', { 'data-version': x.policy_version === null ? '' : x.policy_version },
        h('td', { class: 'num' }, x.policy_version === null ? 'unknown' : 'v' + x.policy_version),
        h('td', { class: 'num' }, String(x.sessions.length)),
        h('td', { class: 'num' }, pm(x.reward.mean, x.reward.se) + ' (n=' + x.reward.n + ')'),
        h('td', { class: 'mono' }, iterationsOf(x.sessions))))));
    const pickers = ['a', 'b'].map((side) => {
      const vkey = side === 'a' ? 'va' : 'vb';
      const cur = vs.find((x) => String(x.policy_version) === String(compareState[vkey])) || vs[0];
      const vsel = h('select', { 'data-keep': 'v' + side, onchange: (ev) => {
        compareState[vkey] = ev.target.value === '' ? null : Number(ev.target.value); compareState[side] = null; syncCompareURL(v.task); refresh(true);
      } }, vs.map((x) => h('option', { value: x.policy_version === null ? '' : x.policy_version, selected: x === cur },
        x.policy_version === null ? 'unknown version' : 'v' + x.policy_version)));
      const ssel = h('select', { 'data-keep': 's' + side, onchange: (ev) => {
        compareState[side] = ev.target.value; syncCompareURL(v.task); refresh(true);
      } }, cur.sessions.map((x) => h('option', { value: x.session_id, selected: x.session_id === compareState[side] },
        x.session_id + (isNum(x.reward) ? '  (reward ' + num(x.reward) + ')' : ''))));
      return h('span', null, h('b', null, side + ': '), vsel, ' ', ssel);
    });
    return [h('h2', null, 'Task ', h('code', null, v.task), ' by policy version'), table, h('div', { class: 'toolbar' }, pickers)];
  }

  function iterationsOf(sessions) {
    // per run: its iterations (a range when there are many); sessions outside a loop: "rollout"
    const runs = new Map();
    for (const x of sessions) {
      const key = x.run_id === null ? 'rollout' : 'run ' + x.run_id + (x.held_out ? ' held-out' : '');
      if (!runs.has(key)) runs.set(key, new Set());
      if (x.iteration !== null) runs.get(key).add(x.iteration);
    }
    return [...runs].map(([key, its]) => {
      const sorted = [...its].sort((a, b) => a - b);
      if (!sorted.length) return key;
      return key + ': ' + (sorted.length <= 6 ? sorted.join(', ')
        : sorted.length + ' iterations, ' + sorted[0] + ' … ' + sorted[sorted.length - 1]);
    }).join('; ');
  }

  function syncCompareURL(task) {
    const p = new URLSearchParams({ task });
    for (const k of ['va', 'vb', 'a', 'b']) if (compareState[k] !== null && compareState[k] !== undefined) p.set(k, compareState[k]);
    history.replaceState(null, '', '/compare?' + p.toString());
  }

  // -- routing, rendering, live updates -------------------------------------------------------------
  function route() {
    const p = location.pathname;
    if (p === '/' || p === '') return 'runs';
    if (p === '/groups' || p === '/groups/') return 'groups';
    if (p.startsWith('/groups/')) return 'group';
    if (p.startsWith('/sessions/')) return 'session';
    if (p.startsWith('/compare')) return 'compare';
    return 'runs';
  }

  const main = document.getElementById('main');
  const status = document.getElementById('status');
  let name = null, page = null, here = null;
  let nav = 0;           // the page shown now: a load for an earlier one is dropped
  let latest = 0;        // the newest generation the event stream announced
  let shown = -1;        // the generation of the data on screen
  let lastText = null;   // its JSON (without the generation): unchanged data is not drawn again
  let lastData = null;
  let busy = false, again = false, retryTimer = null;

  function keepUI() {
    const open = new Set([...main.querySelectorAll('details[data-key]')].filter((x) => x.open).map((x) => x.dataset.key));
    const closed = new Set([...main.querySelectorAll('details[data-key]')].filter((x) => !x.open).map((x) => x.dataset.key));
    const focus = document.activeElement && document.activeElement.dataset ? document.activeElement.dataset.keep : null;
    const caret = focus && document.activeElement.selectionStart;
    return { open, closed, focus, caret, y: window.scrollY };
  }
  function restoreUI(st) {
    for (const x of main.querySelectorAll('details[data-key]')) {
      if (st.open.has(x.dataset.key)) x.open = true;
      else if (st.closed.has(x.dataset.key)) x.open = false;
    }
    if (st.focus) {
      const el = main.querySelector('[data-keep="' + st.focus + '"]');
      if (el) { el.focus(); if (isNum(st.caret) && el.setSelectionRange) el.setSelectionRange(st.caret, st.caret); }
    }
    window.scrollTo(0, st.y);
  }
  function draw(d) {
    const st = keepUI();
    main.replaceChildren(...[].concat(page.render(d)).flat(Infinity).filter((x) => x !== null && x !== undefined));
    restoreUI(st);
  }
  function rerender() { if (lastData) draw(lastData); }

  function showError(e) {
    const box = h('div', { class: 'error-box', id: 'load-error' }, e instanceof NotFound ? 'Not found: ' + e.message : String(e.message || e));
    if (e instanceof NotFound || !lastData) main.replaceChildren(h('h1', null, page.title), box);
    else { const old = document.getElementById('load-error'); if (old) old.remove(); main.prepend(box); }
  }

  async function refresh(force) {
    if (busy) { again = true; return; }
    busy = true;
    if (retryTimer) { clearTimeout(retryTimer); retryTimer = null; }
    const mine = nav;
    let gen = null;
    try {
      const d = await page.load();
      if (mine !== nav) return;            // navigated away meanwhile
      gen = d.generation;
      if (force || d.__text !== lastText) {
        lastText = d.__text;
        lastData = d;
        draw(d);
        document.title = page.title + (page.arg ? ' ' + page.arg() : '') + ' · polar-mitm';
      } else {
        const old = document.getElementById('load-error');
        if (old) old.remove();
      }
    } catch (e) {
      if (mine !== nav) return;
      showError(e);
      gen = latest || 0;
    } finally {
      busy = false;
      if (mine !== nav) refresh();         // the page now shown was left waiting
    }
    shown = Math.max(shown, gen);
    document.body.dataset.generation = String(shown);
    if (again) { again = false; refresh(); }
    else if (latest > shown) retryTimer = setTimeout(refresh, 1000);   // the server answered from before the change
  }

  function enter() {
    nav += 1;
    here = location.pathname + location.search;
    name = route();
    page = pages[name];
    document.body.dataset.page = name;
    for (const a of document.querySelectorAll('header nav a')) {
      a.classList.toggle('active', a.dataset.nav === name || (name === 'group' && a.dataset.nav === 'groups')
        || (name === 'session' && a.dataset.nav === 'groups'));
    }
    shown = -1; lastText = null; lastData = null; again = false;
    if (retryTimer) { clearTimeout(retryTimer); retryTimer = null; }
    compareState.va = compareState.vb = compareState.a = compareState.b = null;
    return busy ? Promise.resolve() : refresh();
  }

  // Links inside the app change the page without loading it again: the event stream stays
  // open (a page load would cut it), and so does everything else the page holds.
  document.addEventListener('click', (ev) => {
    if (ev.defaultPrevented || ev.button !== 0 || ev.metaKey || ev.ctrlKey || ev.shiftKey || ev.altKey) return;
    const a = ev.target.closest && ev.target.closest('a[href]');
    if (!a || a.target || a.hasAttribute('download')) return;
    const url = new URL(a.href, location.href);
    if (url.origin !== location.origin || url.pathname.startsWith('/api/') || url.pathname.startsWith('/static/')) return;
    if (url.pathname === location.pathname && url.search === location.search && url.hash) return;   // an anchor
    ev.preventDefault();
    history.pushState(null, '', url.pathname + url.search + url.hash);
    window.scrollTo(0, 0);
    enter();
  });
  // back and forward; not an anchor's jump within the page
  window.addEventListener('popstate', () => { if (location.pathname + location.search !== here) enter(); });

  function onGeneration(ev) {
    let g = 0;
    try { g = JSON.parse(ev.data).generation; } catch (e) { return; }
    latest = Math.max(latest, g);
    status.textContent = 'live · generation ' + latest;
    status.className = 'live';
    if (latest > shown && !retryTimer) refresh();
  }

  function openStream() {
    if (!window.EventSource) return;
    const es = new EventSource('/api/stream');
    es.addEventListener('hello', onGeneration);
    es.addEventListener('change', onGeneration);
    es.onerror = () => { status.textContent = 'reconnecting…'; status.className = 'offline'; };
    const close = () => es.close();
    window.addEventListener('pagehide', close);
    window.addEventListener('beforeunload', close);
  }

  enter().then(() => {
    // The event stream opens once the page has drawn and settled (tools that wait for the
    // network to go idle see it idle first); it announces the current generation at once,
    // so no change in between is missed.
    setTimeout(openStream, 1200);
  });
})();
