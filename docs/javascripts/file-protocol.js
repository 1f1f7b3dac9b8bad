/* The built site, opened from disk (file://) rather than served: links and search work there too.
 *
 * Loaded in every page's <head> before Material's bundle (`extra.polyfills` in mkdocs.yml); it does
 * nothing when the site is served over http(s). tests/test_browser.py opens the site both ways.
 *
 * 1. A link to a page's directory (`guides/facets/`) opens its index.html: from disk a browser would
 *    show the directory's file listing.
 * 2. Search: Material runs its search in a Web Worker, and Chromium refuses to start a Worker from a
 *    file: page (its origin is opaque), so search stayed at "Initializing search". Here a Worker is
 *    replaced by a hidden same-origin frame that runs the same worker script and passes the same
 *    messages. The index itself comes from search/search_index.js, which scripts/mkdocs_hooks.py
 *    writes next to search_index.json (a page opened from disk cannot fetch a JSON file).
 */
(function () {
  if (location.protocol !== "file:") return;

  document.addEventListener("click", function (event) {
    var link = event.target && event.target.closest ? event.target.closest("a[href]") : null;
    if (link && link.protocol === "file:" && link.pathname.slice(-1) === "/")
      link.pathname += "index.html";
  }, true);

  function FrameWorker(url) {
    var worker = this;
    this._listeners = [];
    this._queue = [];
    this._ready = false;
    this.onmessage = null;
    var frame = document.createElement("iframe");
    frame.hidden = true;
    frame.setAttribute("aria-hidden", "true");
    (document.body || document.documentElement).appendChild(frame);
    var scope = this._scope = frame.contentWindow;
    scope.postMessage = function (data) {  /* the worker's reply */
      setTimeout(function () { worker._emit(data); }, 0);
    };
    scope.importScripts = function () {  /* loads each script in turn */
      var urls = Array.prototype.slice.call(arguments);
      return urls.reduce(function (done, src) {
        return done.then(function () { return load(scope, new URL(src, url).href); });
      }, Promise.resolve());
    };
    load(scope, new URL(url, location.href).href).then(function () {
      worker._ready = true;
      worker._queue.splice(0).forEach(function (data) { worker.postMessage(data); });
    });
  }

  function load(scope, src) {
    return new Promise(function (resolve, reject) {
      var script = scope.document.createElement("script");
      script.src = src;
      script.onload = resolve;
      script.onerror = function () { reject(new Error("could not load " + src)); };
      (scope.document.head || scope.document.documentElement).appendChild(script);
    });
  }

  FrameWorker.prototype.postMessage = function (data) {
    if (!this._ready) return void this._queue.push(data);
    this._scope.dispatchEvent(new this._scope.MessageEvent("message", { data: data }));
  };
  FrameWorker.prototype.addEventListener = function (type, listener) {
    if (type === "message") this._listeners.push(listener);
  };
  FrameWorker.prototype.removeEventListener = function (type, listener) {
    this._listeners = this._listeners.filter(function (l) { return l !== listener; });
  };
  FrameWorker.prototype._emit = function (data) {
    var event = new MessageEvent("message", { data: data });
    if (this.onmessage) this.onmessage(event);
    this._listeners.forEach(function (listener) {
      typeof listener === "function" ? listener(event) : listener.handleEvent(event);
    });
  };
  FrameWorker.prototype.terminate = function () {};

  window.Worker = FrameWorker;
})();
