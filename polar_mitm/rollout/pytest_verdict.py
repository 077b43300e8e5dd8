"""The tests evaluator's runner: one self-contained file that the node writes into a fresh
grading sandbox's TMPDIR (a directory the node made) and runs there with the IMAGE's Python,
`python3 -I` (no workdir, no PYTHON* variables, no user site on sys.path). Standard library
and pytest only (Debian bookworm: Python 3.11, pytest 7.2). Never imported by the node.

    python3 -I pytest_verdict.py prepare CONFIG   before the patch: the task's own tree
    python3 -I pytest_verdict.py restore CONFIG   after it: config restored, shadowing refused
    python3 -I pytest_verdict.py run CONFIG       pytest, with our plugin; the verdict in REPORT

CONFIG (JSON, written by the node): workdir, tests (pytest node ids), plugins (module names the
task loads with -p), state (a node-made directory for this file's own notes), report_dir (a
node-made directory named with a random token, chosen after the session's diff was taken:
the verdict goes to report_dir/report.json), token (that name), pidns (the run is alone in
its PID namespace: the processes the code under test leaves are ended before the report).

`prepare` saves what pytest reads as configuration, as the task has it (every conftest.py,
pytest.ini, .pytest.ini, pytest.toml, .pytest.toml, tox.ini, setup.cfg, pyproject.toml,
sitecustomize/usercustomize, *.pth, *.egg-info, *.dist-info, *.egg-link, the listed test files,
the test packages' __init__.py) and which ini file and rootdir pytest itself finds for the tests.
`restore` (exit 6: refused, the diff's doing) refuses a tree where the diff added or changed a
symbolic link, or a module that shadows the standard library or an installed package on a
directory the run puts on sys.path; removes every configuration file the diff added and puts
the saved ones back. `run` pins the configuration (-c INI --rootdir ROOT), loads no plugin but
ours and the task's (PYTEST_DISABLE_PLUGIN_AUTOLOAD, -p no:cacheprovider), and records each
listed test's phases from pytest's CallInfo in a hook that runs before any other; it checks,
at every phase and at the end, that the machinery which runs and reports tests is what it was
at session start (see `Integrity`). Any change: every listed test is TAMPERED.
"""

import builtins
import json
import os
import shutil
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

REFUSED = 6        # restore: the diff made the tree ungradable (the policy's doing)
BROKEN = 7         # the grader's own trouble (its config unreadable)

CONFIG_NAMES = ("conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg",
                "pyproject.toml", "sitecustomize.py", "usercustomize.py")
CONFIG_SUFFIXES = (".pth", ".egg-info", ".dist-info", ".egg-link")
TEST_DIR_PREFIXES = ("test", "tests", "testing")   # test packages whose __init__.py is the task's
PROTECTED_EXTRA = ("pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging", "attr", "attrs", "tomli",
                   "exceptiongroup")
PASSED = "PASSED"
REPORT = "report.json"     # in the verdict's directory (CONFIG's report_dir)


def _load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _dump(path, data):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


# -- the tree ----------------------------------------------------------------------------

def _walk(root):
    """Every path below root (relative, .git left out): {path: kind}, kind "d", "f", "o" (other)
    or "l:TARGET" for a symbolic link. Links are not followed."""
    out = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            names = os.listdir(os.path.join(root, rel) if rel else root)
        except OSError:
            continue
        for name in names:
            if not rel and name == ".git":
                continue
            p = os.path.join(rel, name) if rel else name
            try:
                st = os.lstat(os.path.join(root, p))
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                try:
                    out[p] = "l:" + os.readlink(os.path.join(root, p))
                except OSError:
                    out[p] = "l:?"
            elif stat.S_ISDIR(st.st_mode):
                out[p] = "d"
                stack.append(p)
            else:
                out[p] = "f" if stat.S_ISREG(st.st_mode) else "o"
    return out


def _is_config(path):
    name = os.path.basename(path)
    return name in CONFIG_NAMES or name.endswith(CONFIG_SUFFIXES)


def _test_dirs(tests):
    """The listed tests' directories (relative), each with its parents."""
    dirs = set()
    for t in tests:
        d = os.path.dirname(t.split("::", 1)[0])
        while d:
            dirs.add(d)
            d = os.path.dirname(d)
    return dirs


def _test_trees(tests):
    """The listed tests' directories that are test directories (a component named test*), and
    their parents that are: everything below one is the task's (a helper module the tests
    import, their data), and nothing new goes there (a module that shadows the code under
    test, found first on the prepended sys.path)."""
    trees = set()
    for d in _test_dirs(tests):
        if any(part.startswith(TEST_DIR_PREFIXES) for part in d.split(os.sep)):
            trees.add(d)
    return trees


def _guarded(path, tests, test_dirs):
    """Is path one the task's own version of which the run sees (its saved copy, or none)?"""
    if _is_config(path):
        return True
    if path in {t.split("::", 1)[0] for t in tests}:
        return True
    if any(path.startswith(d + os.sep) for d in _test_trees(tests)):
        return True
    d, name = os.path.split(path)
    # a test package's __init__.py: the listed tests' own directories, and parents named as tests
    return name == "__init__.py" and d in test_dirs and (
        d in {os.path.dirname(t.split("::", 1)[0]) for t in tests} or os.path.basename(d).startswith(TEST_DIR_PREFIXES))


def _inside(root, rel):
    """Is root/rel reached without a link on the way (every parent a real directory)?"""
    parts = rel.split(os.sep)
    cur = root
    for part in parts[:-1]:
        cur = os.path.join(cur, part)
        try:
            if not stat.S_ISDIR(os.lstat(cur).st_mode):
                return False
        except OSError:
            return False
    return True


def prepare(cfg):
    root, state, tests = cfg["workdir"], cfg["state"], cfg["tests"]
    tree = _walk(root)
    pristine = os.path.join(state, "pristine")
    os.makedirs(pristine, exist_ok=True)
    saved: list = []
    test_dirs = _test_dirs(tests)
    for p, kind in sorted(tree.items()):
        if kind == "o" or not _guarded(p, tests, test_dirs):
            continue
        if any(p.startswith(s + os.sep) for s in saved):   # inside a saved *.egg-info directory
            continue
        src, dst = os.path.join(root, p), os.path.join(pristine, p)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if kind == "d":
            shutil.copytree(src, dst, symlinks=True)
        elif kind.startswith("l:"):
            os.symlink(kind[2:], dst)
        else:
            shutil.copy2(src, dst)
        saved.append(p)
    # the ini file and rootdir pytest itself finds for these tests, in the task's tree
    import inspect

    from _pytest.config import findpaths
    determine_setup: Any = findpaths.determine_setup
    files = [os.path.join(root, t.split("::", 1)[0]) for t in tests]
    kw = {"inifile": None, "args": files, "rootdir_cmd_arg": None, "invocation_dir": Path(root)}
    params = inspect.signature(determine_setup).parameters    # pytest 7 and 8 differ
    rootdir, inipath = determine_setup(**{k: v for k, v in kw.items() if k in params})[:2]
    ini = str(inipath) if inipath else None
    if ini is not None and not os.path.isfile(ini):
        ini = None
    _dump(os.path.join(state, "tree.json"), {"tree": tree, "saved": saved, "ini": ini, "rootdir": str(rootdir)})


def _protected_names():
    """Top-level modules the run imports or may: the standard library, and what sys.path's
    directories hold (site-packages: pytest, _pytest, pluggy, ...). sys.path has no workdir here."""
    import pkgutil
    names = set(sys.stdlib_module_names) | set(sys.builtin_module_names) | set(PROTECTED_EXTRA)
    for entry in sys.path:
        if os.path.isdir(entry):
            names.update(m.name for m in pkgutil.iter_modules([entry]))
    return names


def _module_name(entry):
    """The top-level module an entry of a sys.path directory would provide, or None."""
    if entry.endswith(".py") or entry.endswith(".pyc"):
        return entry.rsplit(".", 1)[0]
    if entry.endswith(".so") or entry.endswith(".pyd"):
        return entry.split(".", 1)[0]
    if "." not in entry:
        return entry
    return None


def _path_dirs(root, tests, ini, rootdir):
    """The directories of the tree a run may put on sys.path: the rootdir and workdir, the ini
    file's `pythonpath`, and the first directory above each listed test file (and each
    conftest.py) without an __init__.py (pytest's prepend import mode)."""
    dirs = {"", os.path.relpath(rootdir, root) if rootdir else ""}
    if ini:
        try:
            from _pytest.config import findpaths
            load: Any = findpaths.load_config_dict_from_file
            raw = (load(Path(ini)) or {}).get("pythonpath", "")
            entries = raw.split() if isinstance(raw, str) else list(raw)
            base = os.path.dirname(ini)
            for e in entries:
                dirs.add(os.path.relpath(os.path.normpath(os.path.join(base, e)), root))
        except Exception:   # an unreadable ini: pytest will say so
            pass
    files = [t.split("::", 1)[0] for t in tests]
    for f in files:
        d = os.path.dirname(f)
        while d and os.path.isfile(os.path.join(root, d, "__init__.py")):
            d = os.path.dirname(d)
        dirs.add(d)
    return {("" if d == "." else d) for d in dirs if not d.startswith("..")}


def restore(cfg):
    root, state, tests = cfg["workdir"], cfg["state"], cfg["tests"]
    before = _load(os.path.join(state, "tree.json"))
    old, saved, ini, rootdir = before["tree"], before["saved"], before["ini"], before["rootdir"]
    new = _walk(root)
    problems = []
    for p, kind in sorted(new.items()):
        if kind.startswith("l:") and old.get(p) != kind:
            problems.append(f"{p}: a symbolic link the diff made ({kind[2:]})")
        elif kind == "o" and old.get(p) != "o":
            problems.append(f"{p}: not a regular file")
    # new modules on the run's sys.path that shadow one it imports: the standard library's, an
    # installed package's, or the task's own in another directory of the path (a tests/stats.py
    # with a right median, found before the stats.py the tests are about)
    protected = _protected_names()
    path_dirs = sorted(_path_dirs(root, tests, ini, rootdir))
    own = {d: {_module_name(os.path.basename(p)) for p in old if os.path.dirname(p) == d} for d in path_dirs}
    for d in path_dirs:
        elsewhere = set().union(*(names for other, names in own.items() if other != d))
        for p, kind in new.items():
            if os.path.dirname(p) != d or p in old:
                continue
            name = _module_name(os.path.basename(p))
            if name in protected:
                problems.append(f"{p}: a new module that shadows {name!r} (the standard library's or an "
                                f"installed package's)")
            elif name in elsewhere:
                problems.append(f"{p}: a new module that shadows the task's own {name!r}")
    if problems:
        print("polar: the tests evaluator refuses this diff:\n  " + "\n  ".join(problems[:20]))
        _dump(os.path.join(state, "refused.json"), problems[:50])
        sys.exit(REFUSED)
    # every configuration file, test file and test package __init__.py: the task's own, or none
    test_dirs = _test_dirs(tests)
    for p in sorted(new, key=len, reverse=True):
        if (_guarded(p, tests, test_dirs) or (os.path.basename(p) == "__init__.py" and os.path.dirname(p)
                                               in test_dirs and p not in old)) and os.path.lexists(os.path.join(root, p)):
            _remove(os.path.join(root, p))
        elif os.path.basename(p) == "__pycache__" or (p.endswith((".pyc", ".pyo")) and p not in old):
            _remove(os.path.join(root, p))
    pristine = os.path.join(state, "pristine")
    for p in saved:
        dst = os.path.join(root, p)
        parent = os.path.dirname(dst)
        # a parent the diff turned into a file goes (links were refused above)
        cur = root
        for part in os.path.relpath(parent, root).split(os.sep) if parent != root else []:
            cur = os.path.join(cur, part)
            if os.path.lexists(cur) and not os.path.isdir(cur):
                _remove(cur)
        os.makedirs(parent, exist_ok=True)
        if not _inside(root, p):
            print(f"polar: {p} cannot be restored (a link on its way)")
            sys.exit(REFUSED)
        if os.path.lexists(dst):
            _remove(dst)
        src = os.path.join(pristine, p)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True)
        else:
            shutil.copy2(src, dst)


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# -- the run -----------------------------------------------------------------------------

# What a run's verdict rests on, bound now (before any code under test is imported): the
# report is written through these, whatever the code under test rebinds later.
_os_write, _os_close, _os_fsync, _os_exit = os.write, os.close, os.fsync, os._exit
_os_kill, _os_listdir, _os_getpid = os.kill, os.listdir, os.getpid
_os_open, _os_unlink = os.open, os.unlink
_json_dumps, _realpath, _open = json.dumps, os.path.realpath, builtins.open

RUNTEST_HOOKS = ("pytest_runtestloop", "pytest_runtest_protocol", "pytest_runtest_setup", "pytest_runtest_call",
                 "pytest_runtest_teardown", "pytest_runtest_makereport", "pytest_pyfunc_call")
# events whose path arguments may not name the verdict's directory (its report)
PATH_EVENTS = ("open", "os.rename", "os.remove", "os.rmdir", "os.link", "os.symlink", "os.truncate", "os.chmod",
               "os.chown", "os.utime", "os.listdir", "os.scandir", "os.chdir", "os.mkdir", "shutil.rmtree",
               "shutil.move", "shutil.copyfile", "os.exec", "os.posix_spawn", "os.spawn")
# events the code under test has no business raising in a grading run
HOSTILE_EVENTS = ("sys.settrace", "sys.setprofile", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
                  "sys._current_frames")
PROTECTED_MODULES = ("_pytest", "pytest", "pluggy", "importlib", "_frozen_importlib", "_frozen_importlib_external",
                     "builtins", __name__)


def _targets():
    """The functions, classes and objects that run and report a test, as (label, getter): each
    getter looks it up again where pytest finds it (a module's or a class's own dict)."""
    import _pytest.assertion.rewrite as rewrite
    import _pytest.main as main
    import _pytest.nodes as nodes
    import _pytest.outcomes as outcomes
    import _pytest.python as python
    import _pytest.reports as reports
    import _pytest.runner as runner
    import _pytest.skipping as skipping
    import importlib._bootstrap as boot
    import importlib._bootstrap_external as ext
    import pluggy._callers as callers
    import pluggy._hooks as hooks
    import pluggy._manager as manager

    out: list[tuple[str, Any]] = []
    modules: Any = ((runner, ("call_and_report", "runtestprotocol", "call_runtest_hook", "CallInfo",
                                 "check_interactive_exception", "pytest_runtest_protocol", "pytest_runtest_setup",
                                 "pytest_runtest_call", "pytest_runtest_teardown", "pytest_runtest_makereport",
                                 "show_test_item")),
                       (reports, ("TestReport",)),
                       (python, ("pytest_pyfunc_call", "Function")),
                       (main, ("pytest_runtestloop", "Session")),
                       (skipping, ("evaluate_xfail_marks", "pytest_runtest_makereport", "pytest_runtest_setup",
                                   "pytest_runtest_call")),
                       (outcomes, ("Skipped", "XFailed", "Failed")),
                       (rewrite, ("AssertionRewritingHook", "_read_pyc", "_rewrite_test", "rewrite_asserts")),
                       (callers, ("_multicall",)),
                       (builtins, ("__import__", "compile", "exec", "eval", "isinstance", "type", "getattr")),
                       (boot, ("_find_and_load", "_load_unlocked", "_find_spec", "module_from_spec")),
                       (ext, ("FileFinder", "SourceFileLoader", "SourceLoader", "FileLoader", "PathFinder")))
    for mod, names in modules:
        name = mod.__name__
        out.append((f"sys.modules[{name}]", lambda name=name: sys.modules.get(name)))
        for n in names:
            out.append((f"{name}.{n}", lambda mod=mod, n=n: vars(mod).get(n)))
    classes: Any = ((runner.CallInfo, ("from_call", "__init__")),
                       (reports.TestReport, ("from_item_and_call", "__init__")),
                       (python.Function, ("runtest", "setup", "_getobj", "obj")),
                       (nodes.Node, ("ihook",)),
                       (main.Session, ("gethookproxy",)),
                       (rewrite.AssertionRewritingHook, ("find_spec", "exec_module", "create_module")),
                       (getattr(hooks, "HookCaller", getattr(hooks, "_HookCaller", None)),
                        ("__call__", "get_hookimpls", "_add_hookimpl")),
                       (manager.PluginManager, ("_hookexec", "register", "subset_hook_caller")),
                       (ext.FileFinder, ("find_spec", "_fill_cache")),
                       (ext.SourceLoader, ("get_code", "source_to_code")),
                       (ext.FileLoader, ("get_data",)),
                       (ext.PathFinder, ("find_spec", "_path_importer_cache", "_get_spec")),
                       (Recorder, tuple(vars(Recorder))),
                       (Integrity, tuple(vars(Integrity))))
    for cls, names in classes:
        if cls is None:
            continue
        for n in names:
            if callable(vars(cls).get(n)) or isinstance(vars(cls).get(n), (classmethod, staticmethod, property)):
                out.append((f"{cls.__qualname__}.{n}", lambda cls=cls, n=n: vars(cls).get(n)))
    me = sys.modules[__name__]
    for n in ("_final", "_kill_strays", "_audit", "_classify", "_write_report", "main_run", "_allowed"):
        out.append((f"runner.{n}", lambda n=n: vars(me).get(n)))
    return out


def _fingerprint(obj):
    """An object's identity, and where it is (or wraps) a function its code's."""
    f = obj
    if isinstance(f, (classmethod, staticmethod)):
        f = f.__func__
    elif isinstance(f, property):
        f = f.fget
    code = getattr(f, "__code__", None)
    return (id(obj), id(f), id(code) if code is not None else None)


def _allowed(plugin, cfg, conftests):
    """May this plugin take part in running and reporting tests? pytest's own modules and
    objects, the task's -p plugins' packages, and the task's conftest.py files (restored)."""
    pkgs = ("_pytest", "pytest", "pluggy", *(p.split(".")[0] for p in cfg.get("plugins", [])))
    if isinstance(plugin, type(sys)):
        name = plugin.__name__
        f = getattr(plugin, "__file__", None)
        if f and os.path.basename(f) == "conftest.py":
            return _realpath(f) in conftests
        return name.split(".")[0] in pkgs
    if isinstance(plugin, Recorder):
        return True
    mod = getattr(plugin if isinstance(plugin, type) else type(plugin), "__module__", "") or ""
    return mod.split(".")[0] in pkgs


def _finders():
    rewriter = vars(sys.modules["_pytest.assertion.rewrite"])["AssertionRewritingHook"]
    return [f for f in sys.meta_path if type(f) is not rewriter]


class Integrity:
    """What runs and reports tests, as it was before any conftest.py or test module (and so
    any code under test) was imported; `check` names what changed since."""

    def __init__(self, pm, cfg, conftests):
        self.pm, self.cfg, self.conftests = pm, cfg, conftests
        self.targets = _targets()
        self.before = {label: _fingerprint(get()) for label, get in self.targets}
        # pytest's assertion rewriter leaves sys.meta_path at its config's cleanup (after the
        # tests): the finders compared are the others
        self.meta_path, self.path_hooks = _finders(), list(sys.path_hooks)
        self.trace, self.profile = sys.gettrace(), sys.getprofile()
        self.thread_trace = getattr(threading, "_trace_hook", None), getattr(threading, "_profile_hook", None)
        self.impls = {}

    def check(self):
        bad = []
        for label, get in self.targets:
            try:
                now = _fingerprint(get())
            except Exception:
                now = None
            if now != self.before[label]:
                bad.append(f"{label} was replaced")
        if _finders()[:len(self.meta_path)] != self.meta_path:
            bad.append("sys.meta_path was changed ahead of the import system's own finders")
        if sys.path_hooks[:len(self.path_hooks)] != self.path_hooks:
            bad.append("sys.path_hooks was changed")
        import importlib._bootstrap_external as ext
        import zipimport
        for key, finder in list(sys.path_importer_cache.items()):
            if finder is not None and type(finder) not in (ext.FileFinder, zipimport.zipimporter):
                bad.append(f"sys.path_importer_cache[{key!r}] is a {type(finder).__name__}")
                break
        if sys.gettrace() is not self.trace or sys.getprofile() is not self.profile:
            bad.append("a trace or profile function was set")
        if (getattr(threading, "_trace_hook", None), getattr(threading, "_profile_hook", None)) != self.thread_trace:
            bad.append("a thread trace or profile function was set")
        if getattr(self.pm, "_inner_hookexec", None) is not vars(sys.modules["pluggy._callers"]).get("_multicall"):
            bad.append("pluggy's hook execution was replaced")
        for name in RUNTEST_HOOKS:
            caller = getattr(self.pm.hook, name, None)
            if caller is None:
                bad.append(f"hook {name} is gone")
                continue
            for impl in caller.get_hookimpls():
                if not _allowed(impl.plugin, self.cfg, self.conftests):
                    bad.append(f"{name}: an implementation from a plugin that is neither pytest's, the task's "
                               f"nor a conftest.py of the task's "
                               f"({getattr(impl.plugin, '__name__', type(impl.plugin).__name__)})")
                    continue
                fp = _fingerprint(impl.function)
                if self.impls.setdefault(id(impl), fp) != fp:
                    bad.append(f"{name}: an implementation was replaced")
        return bad


def _classify(item, when, call):
    """A phase's outcome, from the CallInfo: passed only when it raised nothing."""
    exc = call.excinfo
    if exc is None:
        return "passed"
    import _pytest.outcomes as outcomes
    if isinstance(exc.value, outcomes.XFailed):
        return "xfailed"
    if isinstance(exc.value, outcomes.Skipped):
        return "skipped"
    return "failed" if when == "call" else "error"


class Recorder:
    """Our plugin: given to pytest.main(plugins=[...]), so registered before the ini's, the
    conftest.py files and the test modules are read (before any code under test is imported)."""

    def __init__(self, cfg, report_dir_fd):
        self.cfg = cfg
        self.listed = list(dict.fromkeys(cfg["tests"]))
        self.dir_fd = report_dir_fd
        self.phases = {}           # nodeid -> {when: outcome}
        self.marked = {}           # nodeid -> "XFAIL" where an xfail mark applies
        self.tampered = []
        self.integrity = None
        self.collected = 0
        self.armed = False

    def flag(self, why):
        if why not in self.tampered:
            self.tampered.append(why)

    @pytest.hookimpl(tryfirst=True)
    def pytest_load_initial_conftests(self, early_config):
        # the first hook before a conftest.py is imported: what runs tests is snapshot now
        conftests = {_realpath(os.path.join(self.cfg["workdir"], p)) for p in self.cfg.get("conftests", [])}
        self.integrity = Integrity(early_config.pluginmanager, self.cfg, conftests)
        self.armed = True

    def pytest_plugin_registered(self, plugin, manager):
        if self.integrity is not None and not _allowed(plugin, self.cfg, self.integrity.conftests):
            self.flag(f"a plugin was registered during the run: {getattr(plugin, '__name__', type(plugin).__name__)}")

    def pytest_collection_finish(self, session):
        self.collected = len(session.items)

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item, call):
        # runs first: the outcome is read from the CallInfo pytest made, before any other
        # implementation (or a TestReport) exists
        self._record(item, call, sys._getframe(1))
        yield

    def _record(self, item, call, caller):
        runner = sys.modules["_pytest.runner"]
        nodeid = item.nodeid
        when = getattr(call, "when", None)
        # who asked: pluggy's _multicall, for pytest's call_and_report
        frames: list = []
        f = caller
        while f is not None and len(frames) < 8:
            frames.append(f.f_code)
            f = f.f_back
        multicall = vars(sys.modules["pluggy._callers"])["_multicall"].__code__
        if not frames or frames[0] is not multicall or vars(runner)["call_and_report"].__code__ not in frames:
            self.flag(f"{nodeid}: a report was asked for outside pytest's runner")
            return
        if type(call) is not vars(runner)["CallInfo"] or when not in ("setup", "call", "teardown"):
            self.flag(f"{nodeid}: not pytest's own CallInfo")
            return
        phases = self.phases.setdefault(nodeid, {})
        if when in phases:
            self.flag(f"{nodeid}: its {when} phase ran twice")
            return
        if when == "call" and nodeid in self.listed:
            self._check_item(item)
        phases[when] = _classify(item, when, call)
        if when == "setup":
            try:
                if vars(sys.modules["_pytest.skipping"])["evaluate_xfail_marks"](item) is not None:
                    self.marked[nodeid] = "XFAIL"
            except Exception as e:   # a mark pytest itself cannot evaluate: not a pass
                self.marked[nodeid] = f"ERROR ({type(e).__name__})"
        if self.integrity is not None:
            for why in self.integrity.check():
                self.flag(why)

    def _check_item(self, item):
        """The test function is the test file's own: defined there, run by pytest's runtest."""
        python = sys.modules["_pytest.python"]
        if "runtest" in vars(item) or (isinstance(item, python.Function) and
                                       type(item).runtest is not vars(python.Function)["runtest"]):
            self.flag(f"{item.nodeid}: its runtest was replaced")
        fn = getattr(item, "obj", None)
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        try:
            same = code is not None and os.path.samefile(code.co_filename, str(item.path))
        except OSError:
            same = False
        if not same:
            self.flag(f"{item.nodeid}: its test function is not the test file's own")

    def verdict(self):
        tests = {}
        for t in self.listed:
            ph = self.phases.get(t)
            if not ph:
                tests[t] = "MISSING"
            elif ph.get("setup") != "passed":
                tests[t] = {"skipped": "SKIPPED", "xfailed": "XFAIL"}.get(ph.get("setup", ""), "ERROR")
            elif "call" not in ph:
                tests[t] = "MISSING"
            elif ph["call"] != "passed":
                tests[t] = {"skipped": "SKIPPED", "xfailed": "XFAIL"}.get(ph["call"], "FAILED")
            elif t in self.marked:
                tests[t] = "XPASS" if self.marked[t] == "XFAIL" else self.marked[t]
            elif ph.get("teardown") != "passed":
                tests[t] = "ERROR"
            else:
                tests[t] = PASSED
        if self.tampered:
            tests = {t: "TAMPERED" for t in tests}
        return tests


def _audit(recorder, token, verdict_dir):
    """An audit hook (it can never be removed): once the session started, the verdict's
    directory is off limits, and so are tracing and the garbage collector's object lists."""
    vdir = _realpath(verdict_dir)

    def names_verdict(arg):
        if isinstance(arg, bytes):
            arg = arg.decode("utf-8", "replace")
        if not isinstance(arg, str):
            arg = getattr(arg, "__fspath__", None) and arg.__fspath__()
            if not isinstance(arg, str):
                return False
        if token in arg:
            return True
        try:
            r = _realpath(arg)
        except Exception:
            return False
        return r == vdir or r.startswith(vdir + os.sep)

    def hook(event, args):
        if not recorder.armed:
            return
        if event in HOSTILE_EVENTS:
            recorder.flag(f"the code under test called {event}")
        elif event == "object.__setattr__" and args:
            obj = args[0]
            mod = getattr(obj, "__module__", "") or ""
            if isinstance(mod, str) and (mod.split(".")[0] in PROTECTED_MODULES or mod == __name__):
                recorder.flag(f"the code under test set {getattr(obj, '__qualname__', obj)!r}.{args[1]}")
        elif event in PATH_EVENTS:
            for a in args[:2] if event != "os.exec" else args[:1]:
                if names_verdict(a):
                    recorder.flag(f"the code under test reached the verdict's directory ({event})")
                    raise PermissionError("the verdict's directory is the grader's")
    sys.addaudithook(hook)


def _zombie(pid):
    """Has it ended (a zombie its parent has not reaped: it can do nothing more)?"""
    try:
        with _open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def _kill_strays():
    """Every other process of this PID namespace (the grading sandbox's own), but our
    ancestors: what the code under test started cannot outlive the report."""
    me = _os_getpid()
    keep = {me, 1}
    pid = me
    for _ in range(64):
        try:
            with _open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if ppid <= 1:
            break
        keep.add(ppid)
        pid = ppid
    for _ in range(50):
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:    # our own children, ended: reaped
                pass
        except ChildProcessError:
            pass
        found = [int(p) for p in _os_listdir("/proc") if p.isdigit() and int(p) not in keep and not _zombie(p)]
        if not found:
            return True
        for p in found:
            try:
                _os_kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    return False


def _write_report(dir_fd, data):
    """The report, made anew in the verdict's directory (held open since the start: a
    directory moved or a file replaced under its name meanwhile changes nothing here)."""
    raw = _json_dumps(data).encode()
    try:
        _os_unlink(REPORT, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    fd = _os_open(REPORT, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    view, off = memoryview(raw), 0
    while off < len(raw):
        off += _os_write(fd, view[off:])
    _os_fsync(fd)
    _os_close(fd)


def _final(recorder, ret):
    if recorder.integrity is not None:
        for why in recorder.integrity.check():
            recorder.flag(why)
    elif recorder.listed:
        recorder.flag("the run never reached its first conftest.py")
    if recorder.cfg.get("pidns") and not _kill_strays():
        recorder.flag("processes the code under test started would not end")
    _write_report(recorder.dir_fd, {"version": 1, "exitstatus": ret, "tests": recorder.verdict(),
                                    "tampered": recorder.tampered[:20], "collected": recorder.collected})


def main_run(cfg):
    report_dir = cfg["report_dir"]
    dir_fd = os.open(report_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    before = _load(os.path.join(cfg["state"], "tree.json"))
    root = cfg["workdir"]
    cfg["conftests"] = [p for p in before["tree"] if os.path.basename(p) == "conftest.py"]
    recorder = Recorder(cfg, dir_fd)
    _audit(recorder, cfg["token"], report_dir)
    for var in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        os.environ.pop(var, None)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    ini = before["ini"]
    if ini is None:      # no ini of the task's: an empty one of ours, and conftest.py files from the workdir
        ini = os.path.join(cfg["state"], "empty.ini")
        with open(ini, "w") as f:
            f.write("[pytest]\n")
    args = [*cfg["tests"], "-c", ini, "--rootdir", before["rootdir"] or root, "-p", "no:cacheprovider", "-rA"]
    if before["ini"] is None:
        args += ["--confcutdir", root]
    for p in cfg.get("plugins", []):
        args += ["-p", p]
    sys.stdout.flush()
    ret = int(pytest.main(args, plugins=[recorder]))
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    _final(recorder, ret)
    _os_exit(ret)


def main(argv):
    if len(argv) != 3 or argv[1] not in ("prepare", "restore", "run"):
        print(f"usage: {argv[0]} prepare|restore|run CONFIG", file=sys.stderr)
        return BROKEN
    try:
        cfg = _load(argv[2])
    except (OSError, ValueError) as e:
        print(f"polar: the grader's config is unreadable: {e}", file=sys.stderr)
        return BROKEN
    if argv[1] == "prepare":
        prepare(cfg)
    elif argv[1] == "restore":
        restore(cfg)
    else:
        main_run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
