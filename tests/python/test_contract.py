"""Every constant of python/mlc_lora/contract.py is defined there and nowhere else.

The finder reads the contract module itself (every public constant and the literals of
`cache_dir()`), then looks through the sources (python/, compiler_passes/, src/, cpp/, include/,
examples/, scripts/) for a second definition of one of them:
- a string constant (a file name, a function-name suffix, an environment variable) spelled out
  again: a Python string literal or f-string part equal to it, a quoted C/C++ string equal to it,
  the word itself in CMake or shell; for a suffix also "prefill<suffix>" / "decode<suffix>";
- a number assigned to a name that names it again (`PAGE = 16`, `page_size: int = 16`,
  `kPageSize = 16`, `{"page_size": 16}`, `set(PAGE_SIZE 16)`);
- a list of names written out again: a Python list/tuple/set of string literals, or a C/C++ brace
  list of quoted strings, holding every name of a contract tuple (a subset chosen for a purpose,
  e.g. the attention linears, is not a second definition; a dict that gives each name its own
  value, e.g. a shape, is data about the names, not the list).
Code reads the contract instead: Python imports mlc_lora.contract, CMake reads it with
contract.cmake, C++ reads the "contract" block of a compiled config.

Tests under tests/ are not searched: they spell the values out on purpose, as independent
references.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "python" / "mlc_lora" / "contract.py"
SEARCHED = ("python", "compiler_passes", "src", "cpp", "include", "examples", "scripts", "CMakeLists.txt")
SKIP_DIRS = {"__pycache__", "build", ".venv", ".dev"}
C_EXT = {".cc", ".h", ".c", ".cu", ".cuh", ".inc"}

# A literal equal to a contract string that names something else, with what it names.
NOT_THE_CONTRACT = {
    # Hugging Face's file name inside a model folder we read from, not our compiled folder's
    ("python/mlc_lora/loader/hf.py", "tokenizer.json"): "the tokenizer file of a Hugging Face model folder",
}


# --- what the contract defines -------------------------------------------------------------------

def contract_constants(source: str) -> dict[str, object]:
    """name -> value of every public constant assigned at the top level of contract.py, plus
    `cache_dir()`'s literals (its environment variable and its folder under the home)."""
    tree = ast.parse(source)
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.isupper():
                out[name] = ast.literal_eval(node.value)
        elif isinstance(node, ast.FunctionDef) and node.name == "cache_dir":
            body = node.body[1:] if ast.get_docstring(node) else node.body
            strings = [n.value for b in body for n in ast.walk(b)
                       if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            # the environment variable, and the hidden folder it defaults under ("mlc_lora" alone
            # is the package's name everywhere)
            out["cache_dir()"] = tuple(s for s in strings if s.isupper() or s.startswith("."))
    return out


def _words(name: str) -> list[str]:
    """PAGE_SIZE, page_size, kPageSize, PageSize -> ['page', 'size']."""
    name = re.sub(r"^k(?=[A-Z])", "", name)
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return [w for w in name.lower().split("_") if w]


def _names_it(target: str, constant: str) -> bool:
    """`target` (a variable, key or parameter) names the contract constant `constant`: its words
    are among the constant's and it has the constant's first word (PAGE, page_size, kPageSize,
    max_top_logprobs)."""
    t, c = _words(target), _words(constant)
    return bool(t) and c[0] in t and set(t) <= set(c)


class Rules:
    """The second definitions to look for, made from the contract's values."""

    def __init__(self, constants: dict[str, object]):
        self.strings: dict[str, str] = {}   # literal -> constant it repeats
        self.numbers: dict[str, int] = {}   # constant -> value
        self.lists: dict[str, frozenset] = {}
        for name, value in constants.items():
            if isinstance(value, bool):
                continue
            if isinstance(value, str):
                self.strings[value] = name
                if name.endswith("_SUFFIX"):
                    for fn in ("prefill", "decode"):
                        self.strings[fn + value] = name
            elif isinstance(value, int):
                self.numbers[name] = value
            elif isinstance(value, dict):  # an environment: its variable names
                for key in value:
                    self.strings[key] = name
            elif isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
                if name == "cache_dir()":
                    for v in value:
                        self.strings[v] = name
                elif len(value) >= 2:
                    self.lists[name] = frozenset(value)

    def string_hit(self, literal: str) -> str | None:
        """The constant `literal` repeats: equal to it, or a path ending in a contract file name."""
        if literal in self.strings:
            return self.strings[literal]
        tail = literal.rpartition("/")[2]
        return self.strings.get(tail) if "/" in literal and "." in tail else None

    def _list_hits(self, items: list[str]) -> list[str]:
        """The contract lists `items` holds in full (the largest only: all seven Llama linears
        hold the column-parallel ones too)."""
        held = {name: names for name, names in self.lists.items() if names <= set(items)}
        return [name for name, names in held.items() if not any(names < other for other in held.values())]

    def _number_hits(self, target: str, value) -> list[str]:
        return [name for name, v in self.numbers.items()
                if isinstance(value, int) and not isinstance(value, bool) and value == v and _names_it(target, name)]

    # --- Python: by its syntax tree -----------------------------------------------------------

    def python(self, source: str) -> list[tuple[int, str, str]]:
        """(line, constant, what) of every second definition in Python `source`."""
        hits = []
        tree = ast.parse(source)
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if self.string_hit(node.value):
                    hits.append((node.lineno, self.string_hit(node.value), repr(node.value)))
            elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                items = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if items and len(items) == len(node.elts):
                    hits += [(node.lineno, n, f"a list of its {len(items)} names") for n in self._list_hits(items)]
            # numbers: assignments, annotated assignments, keyword arguments, defaults, dict entries
            pairs = []
            if isinstance(node, ast.Assign):
                pairs = [(t.id if isinstance(t, ast.Name) else getattr(t, "attr", ""), node.value)
                         for t in node.targets if isinstance(t, (ast.Name, ast.Attribute))]
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                t = node.target
                pairs = [(t.id if isinstance(t, ast.Name) else getattr(t, "attr", ""), node.value)]
            elif isinstance(node, ast.keyword) and node.arg:
                pairs = [(node.arg, node.value)]
            elif isinstance(node, ast.arguments):
                args = node.posonlyargs + node.args
                pairs = list(zip([a.arg for a in args[len(args) - len(node.defaults):]], node.defaults))
                pairs += [(a.arg, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
            elif isinstance(node, ast.Dict):
                pairs = [(k.value, v) for k, v in zip(node.keys, node.values)
                         if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            for target, value in pairs:
                if isinstance(value, ast.Constant):
                    hits += [(value.lineno, n, f"{target} = {value.value!r}")
                             for n in self._number_hits(target, value.value)]
        return hits

    # --- C/C++, CMake, shell: by their text ---------------------------------------------------

    def text(self, source: str, kind: str) -> list[tuple[int, str, str]]:
        """(line, constant, what) of every second definition in C/C++ ("c"), CMake or shell
        ("cmake", "sh") `source`, comments left out."""
        code = _strip_comments(source, kind)
        line = lambda pos: code.count("\n", 0, pos) + 1  # noqa: E731
        hits = []
        if kind == "c":
            for m in re.finditer(r'"((?:[^"\\\n]|\\.)*)"', code):
                if self.string_hit(m.group(1)):
                    hits.append((line(m.start()), self.string_hit(m.group(1)), m.group(0)))
            for m in re.finditer(r"\{([^{}]*)\}", code):
                items = re.findall(r'"((?:[^"\\\n]|\\.)*)"', m.group(1))
                hits += [(line(m.start()), n, f"a brace list of its {len(items)} names")
                         for n in self._list_hits(items)]
            assign = r"\b(\w+)\s*(?:=|\{|\()\s*(\d+)\b"
        else:
            for s, name in self.strings.items():
                for m in re.finditer(rf"(?<![\w.-]){re.escape(s)}(?![\w-])", code):
                    hits.append((line(m.start()), name, s))
            assign = r"\b(\w+)[ \t]*(?:=|[ \t])[ \t]*(\d+)\b" if kind == "cmake" else r"\b(\w+)=(\d+)\b"
        for m in re.finditer(assign, code):
            hits += [(line(m.start()), n, m.group(0)) for n in self._number_hits(m.group(1), int(m.group(2)))]
        return hits


def _strip_comments(source: str, kind: str) -> str:
    """`source` with its comments blanked (line breaks kept, so line numbers hold)."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))  # noqa: E731
    if kind == "c":  # strings first, so that "//" inside one is no comment
        return re.sub(r'"(?:[^"\\\n]|\\.)*"|(//[^\n]*|/\*.*?\*/)',
                      lambda m: blank(m) if m.group(1) else m.group(0), source, flags=re.S)
    return re.sub(r"(?m)(^|\s)#[^\n]*", blank, source)


def _kind(path: Path) -> str | None:
    if path.suffix == ".py":
        return "py"
    if path.suffix in C_EXT:
        return "c"
    if path.name == "CMakeLists.txt" or path.suffix == ".cmake":
        return "cmake"
    if path.suffix == ".sh":
        return "sh"
    return None


def source_files() -> list[Path]:
    out = []
    for top in SEARCHED:
        base = ROOT / top
        if base.is_file():
            out.append(base)
            continue
        for folder, dirs, files in os.walk(base):  # symlinks not followed (python/mlc_lora/compiler_passes)
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
            out += [Path(folder) / f for f in sorted(files)]
    return [p for p in out if p != CONTRACT and not p.is_symlink() and _kind(p)]


def second_definitions(rules: Rules) -> list[str]:
    found = []
    for path in source_files():
        rel = path.relative_to(ROOT).as_posix()
        kind = _kind(path)
        text = path.read_text(errors="replace")
        hits = rules.python(text) if kind == "py" else rules.text(text, kind)
        for line, name, what in hits:
            if (rel, what.strip("'\"")) not in NOT_THE_CONTRACT:
                found.append(f"{rel}:{line}: {what} repeats contract.{name}")
    return found


@pytest.fixture(scope="module")
def rules() -> Rules:
    return Rules(contract_constants(CONTRACT.read_text()))


# --- the finder finds what it must -----------------------------------------------------------

def test_the_contract_is_read(rules):
    assert rules.numbers["PAGE_SIZE"] == 16
    assert rules.strings["mlc-lora-config.json"] == "CONFIG_FILE"
    assert rules.strings["NCCL_NVLS_ENABLE"] == "NCCL_ENV"
    assert rules.strings["MLC_LORA_CACHE"] == rules.strings[".cache"] == "cache_dir()"
    assert rules.strings["prefill_base"] == "BASE_FUNCTION_SUFFIX"
    assert {"LORA_MODULES", "LORA_TABLE_INPUTS", "LORA_KERNELS", "SAMPLER_FUNCTIONS"} <= set(rules.lists)


INJECTED_PY = {
    "PAGE_SIZE = 16": "PAGE_SIZE",
    "PAGE = 16": "PAGE_SIZE",
    "def f(x, page_size: int = 16): pass": "PAGE_SIZE",
    "def f(x, *, page_size=16): pass": "PAGE_SIZE",
    "make(page_size=16)": "PAGE_SIZE",
    "cfg = {'page_size': 16}": "PAGE_SIZE",
    "self.page_size = 16": "PAGE_SIZE",
    "MAX_TOP_LOGPROBS = 20": "TOP_LOGPROBS_MAX",
    "p = folder / 'mlc-lora-config.json'": "CONFIG_FILE",
    "p = folder / 'params.safetensors'": "PARAMS_FILE",
    "fn = vm[f'{name}_base']": "BASE_FUNCTION_SUFFIX",
    "fn = vm['decode_base']": "BASE_FUNCTION_SUFFIX",
    "os.environ.setdefault('NCCL_NVLS_ENABLE', '0')": "NCCL_ENV",
    "d = Path.home() / '.cache' / 'mlc_lora'": "cache_dir()",
    "d = os.environ['MLC_LORA_CACHE']": "cache_dir()",
    "MODULES = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']": "LORA_MODULES",
    "p.add_argument('--kernel', choices=('single', 'gather', 'sgmv'))": "LORA_KERNELS",
    "ok = {'sample_argmax', 'sample_top_p', 'chosen_logprobs', 'top_logprobs', 'process_logits'}": "SAMPLER_FUNCTIONS",
}


@pytest.mark.parametrize("source", INJECTED_PY)
def test_finds_a_python_second_definition(rules, source):
    assert [name for _, name, _ in rules.python(source)] == [INJECTED_PY[source]]


INJECTED_TEXT = {
    ('constexpr int kPageSize = 16;', "c"): "PAGE_SIZE",
    ('int64_t page_size{16};', "c"): "PAGE_SIZE",
    ('setenv("NCCL_NVLS_ENABLE", "0", 0);', "c"): "NCCL_ENV",
    ('std::string cfg = dir + "/mlc-lora-config.json";', "c"): "CONFIG_FILE",
    ('auto f = vm.GetFunction(std::string("prefill") + "_base");', "c"): "BASE_FUNCTION_SUFFIX",
    ('const char* kMods[] = {"q_proj", "k_proj", "v_proj", "o_proj",\n "gate_proj", "up_proj", "down_proj"};', "c"):
        "LORA_MODULES",
    ("set(PAGE_SIZE 16)", "cmake"): "PAGE_SIZE",
    ("NCCL_NVLS_ENABLE=0 python -m mlc_lora.runner.worker", "sh"): "NCCL_ENV",
}


@pytest.mark.parametrize("source,kind", INJECTED_TEXT)
def test_finds_a_text_second_definition(rules, source, kind):
    assert [name for _, name, _ in rules.text(source, kind)] == [INJECTED_TEXT[source, kind]]


NOT_DEFINITIONS_PY = [
    "from mlc_lora.contract import PAGE_SIZE\ndef f(page_size: int = PAGE_SIZE): pass",
    '"""Pages of 16 tokens, cached under ~/.cache/mlc_lora; see mlc-lora-config.json."""',
    "attn = ('q_proj', 'k_proj', 'v_proj', 'o_proj')",  # a subset, chosen for a purpose
    "shapes = {'q_proj': (h, q), 'k_proj': (h, kv)}",
    "batch_size = 16\npage_count = 16\nrope = cfg['rope.freq_base']",
    "top_k = 20",
]


@pytest.mark.parametrize("source", NOT_DEFINITIONS_PY)
def test_uses_and_mentions_are_no_definitions(rules, source):
    assert rules.python(source) == []


def test_comments_are_no_definitions(rules):
    assert rules.text('// pages of 16 tokens; kPageSize = 16 was\n/* setenv("NCCL_NVLS_ENABLE") */\n'
                      'int x = MLC_LORA_PAGE_SIZE;', "c") == []
    assert rules.text("# NCCL_NVLS_ENABLE=0 is set by the runner\nset(X 1)", "cmake") == []


# --- the repository ---------------------------------------------------------------------------

def test_each_contract_constant_is_defined_once(rules):
    files = source_files()
    assert len(files) > 100 and ROOT / "src" / "runtime" / "nccl_ccl.cc" in files
    found = second_definitions(rules)
    assert found == [], "read these from mlc_lora.contract (C++: the config's contract block):\n" + "\n".join(found)


def test_exceptions_are_still_needed(rules):
    """Each NOT_THE_CONTRACT entry still matches a literal (else it goes)."""
    for rel, literal in NOT_THE_CONTRACT:
        text = (ROOT / rel).read_text()
        assert any(what.strip("'\"") == literal for _, _, what in rules.python(text)), (rel, literal)


def test_the_runtime_library_has_the_contract_nccl_env():
    """CMake hands contract.NCCL_ENV to nccl_ccl.cc (contract.cmake): the built library holds it."""
    from mlc_lora import _lib
    from mlc_lora.contract import NCCL_ENV

    lib = _lib.load_library()
    data = Path(lib._name).read_bytes()  # pylint: disable=protected-access
    assert " ".join(f"{k}={v}" for k, v in NCCL_ENV.items()).encode() + b"\0" in data
