/* mailrelay Queue Viewer: live updates without a reload, the last-hour chart,
 * and the select-all checkbox. No library: the page polls one small JSON
 * endpoint (counts, states, next retry) every few seconds and patches the
 * elements that carry data-live-* attributes. */
(function () {
  "use strict";

  // Tests set window.mailrelayPollMs (before the page loads) to poll faster.
  var POLL_MS = window.mailrelayPollMs || 5000;
  var SVG = "http://www.w3.org/2000/svg";
  var body = document.body;
  var liveUrl = body.getAttribute("data-live-url");

  function each(selector, fn, root) {
    Array.prototype.forEach.call((root || document).querySelectorAll(selector), fn);
  }

  function setText(el, text) {
    if (el && el.textContent !== text) {
      el.textContent = text;
    }
  }

  function setBadge(el, key, label) {
    if (!el) return;
    el.className = "badge " + key;
    setText(el, label);
  }

  // --- select all -------------------------------------------------------------
  each("input[data-select-all]", function (box) {
    var form = document.getElementById(box.getAttribute("data-select-all"));
    box.addEventListener("change", function () {
      each("input[name=ids]", function (c) { c.checked = box.checked; }, form);
    });
  });

  // --- confirmations for destructive single actions ---------------------------
  each("form[data-confirm]", function (form) {
    form.addEventListener("submit", function (ev) {
      if (!window.confirm(form.getAttribute("data-confirm"))) ev.preventDefault();
    });
  });

  // --- live updates -----------------------------------------------------------
  function ids(attr) {
    var out = [];
    each("[" + attr + "]", function (el) {
      var id = el.getAttribute(attr);
      if (out.indexOf(id) < 0) out.push(id);
    });
    return out.slice(0, 200);
  }

  function applyQueues(queues) {
    each("[data-queue-id]", function (row) {
      var q = queues[row.getAttribute("data-queue-id")];
      if (!q) return;
      setText(row.querySelector("[data-live=count]"), String(q.count));
      setBadge(row.querySelector("[data-live=status]"), q.status, q.status_label);
      setText(row.querySelector("[data-live=next_retry]"), q.next_retry);
      setText(row.querySelector("[data-live=last_error]"), q.last_error);
      setText(row.querySelector("[data-live=rate_in]"), q.rate_in);
      setText(row.querySelector("[data-live=rate_out]"), q.rate_out);
      setText(row.querySelector("[data-live=oldest]"), q.oldest);
    });
  }

  function applyMessages(messages) {
    each("[data-message-id]", function (row) {
      var m = messages[row.getAttribute("data-message-id")];
      if (!m) return;
      var notice = row.querySelector("[data-live=changed]");
      if (notice && m.status !== row.getAttribute("data-status")) notice.hidden = false;
      setBadge(row.querySelector("[data-live=status]"), m.status, m.status_label);
      setText(row.querySelector("[data-live=attempts]"), String(m.attempts));
      setText(row.querySelector("[data-live=last_error]"), m.last_error);
    });
  }

  function applyTotals(totals) {
    each("[data-live-total]", function (el) {
      var v = totals[el.getAttribute("data-live-total")];
      if (v !== undefined) setText(el, String(v));
    });
  }

  // --- chart: queue depth (line) and deliveries per minute (bars), last hour ---
  function el(name, attrs, parent) {
    var node = document.createElementNS(SVG, name);
    Object.keys(attrs).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (parent) parent.appendChild(node);
    return node;
  }

  // Four equal steps of 1, 2, 2.5 or 5 × 10^k that reach v (at least 4 in all).
  function niceMax(v) {
    var step = Math.max(v, 4) / 4;
    var p = Math.pow(10, Math.floor(Math.log10(step)));
    var steps = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < steps.length; i++) {
      if (step <= steps[i] * p) return 4 * steps[i] * p;
    }
    return 40 * p;
  }

  function tick(v) {
    return v >= 10 || v === Math.round(v) ? String(Math.round(v)) : v.toFixed(1);
  }

  function drawChart(svg, points) {
    var box = svg.getBoundingClientRect();
    var W = Math.max(300, Math.round(box.width)), H = Math.max(120, Math.round(box.height));
    var L = 48, R = 48, T = 10, B = 22;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    if (!points || !points.length) {
      var t = el("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, svg);
      t.textContent = "No history yet";
      return;
    }
    var n = points.length;
    var maxDepth = niceMax(Math.max.apply(null, points.map(function (p) { return p.depth; })));
    var maxRate = niceMax(Math.max.apply(null, points.map(function (p) { return p.delivered; })));
    var pw = W - L - R, ph = H - T - B;
    // One band per sample; the line joins the band centres, bars fill the bands.
    var band = pw / n;
    var x = function (i) { return L + (i + 0.5) * band; };
    var yd = function (v) { return T + ph - (v / maxDepth) * ph; };
    var yr = function (v) { return T + ph - (v / maxRate) * ph; };
    for (var g = 0; g <= 4; g++) {
      var gy = T + (g * ph) / 4;
      el("line", { x1: L, x2: L + pw, y1: gy, y2: gy, "class": "grid" }, svg);
      var lt = el("text", { x: L - 6, y: gy + 3, "text-anchor": "end" }, svg);
      lt.textContent = tick(maxDepth * (1 - g / 4));
      var rt = el("text", { x: L + pw + 6, y: gy + 3 }, svg);
      rt.textContent = tick(maxRate * (1 - g / 4));
    }
    var bw = Math.max(1, Math.min(band - 1, 24));
    points.forEach(function (p, i) {
      if (p.delivered > 0) {
        el("rect", { x: x(i) - bw / 2, y: yr(p.delivered), width: bw, height: T + ph - yr(p.delivered), "class": "rate" }, svg);
      }
    });
    var line = points.map(function (p, i) { return (i ? "L" : "M") + x(i).toFixed(1) + "," + yd(p.depth).toFixed(1); }).join(" ");
    el("path", { d: line + " L" + x(n - 1).toFixed(1) + "," + (T + ph) + " L" + x(0).toFixed(1) + "," + (T + ph) + " Z", "class": "depth-area" }, svg);
    el("path", { d: line, "class": "depth" }, svg);
    if (n === 1) el("circle", { cx: x(0), cy: yd(points[0].depth), r: 3, "class": "depth" }, svg);
    el("line", { x1: L, x2: L + pw, y1: T + ph, y2: T + ph, "class": "axis" }, svg);
    var labelled = n === 1 ? [0] : [0, Math.floor((n - 1) / 2), n - 1];
    labelled.forEach(function (i, k) {
      var anchor = n === 1 ? "middle" : k === 0 ? "start" : k === 2 ? "end" : "middle";
      var tx = el("text", { x: n === 1 ? x(i) : k === 0 ? L : k === 2 ? L + pw : x(i), y: H - 6, "text-anchor": anchor }, svg);
      tx.textContent = points[i].label;
    });
  }

  var chart = document.getElementById("history-chart");
  var lastHistory = null;

  function poll() {
    if (!liveUrl) return;
    var params = [];
    var q = ids("data-queue-id"), m = ids("data-message-id");
    if (q.length) params.push("queues=" + q.join(","));
    if (m.length) params.push("messages=" + m.join(","));
    if (chart) params.push("history=1");
    var url = liveUrl + (params.length ? "?" + params.join("&") : "");
    fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (data) {
        if (!data) return;
        applyTotals(data.totals || {});
        applyQueues(data.queues || {});
        applyMessages(data.messages || {});
        if (chart && data.history) {
          lastHistory = data.history;
          drawChart(chart, lastHistory);
        }
        body.setAttribute("data-live-updated", data.now || "");
      })
      .catch(function () { /* the next poll tries again */ });
  }

  window.addEventListener("resize", function () {
    if (chart && lastHistory) drawChart(chart, lastHistory);
  });
  poll();
  window.setInterval(function () {
    if (!document.hidden) poll();
  }, POLL_MS);
})();
