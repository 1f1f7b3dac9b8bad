"""Knowledge kept in one place: the model families, the peer engines and the naming generations
are each one registry of typed rows, checked when it is built.

- `torchlens.testing.FAMILIES`: one `Family` row per model family (config, title, slug, the
  structure TorchLens must find, whether the tests, the zoo, the diagrams, the op graphs and the
  engines use it), checked by `testing.check_families` on import.
- `tests/fixtures/engines.py`: one `Engine` row per peer engine (distribution, import name,
  title, environment, pins, recipe), checked by `check_engines` on import; the rows with an
  environment are the files of `envs/`.
- each naming `Table` of `mechinterp.GENERATIONS` carries its generation's metadata (heading,
  slug, library, the release checked against), checked by `check_table` when it is built.

A planted bad row of each is refused, naming the row. The last tests scan `tests/` and
`scripts/` for a literal list of family or engine names outside the registries: a second list
that would have to be kept in step with the first.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest
from fixtures import engine_runs as er
from fixtures.engines import ENGINES, Engine, check_engines

import torchlens.mechinterp as mi
from torchlens import testing
from torchlens._naming.tables import Row, Table, TableError

REPO = pathlib.Path(__file__).resolve().parents[1]
F = testing.FAMILIES

# -- the families ----------------------------------------------------------------------------------


def _structure(name: str, **changes) -> testing.Structure:
    return dataclasses.replace(F[name].structure, **changes)


@pytest.mark.parametrize(
    "rows, message",
    [
        ((F["gpt2"], F["gpt2"]), "its name 'gpt2' is another family's"),
        (
            (F["gpt2"], dataclasses.replace(F["llama"], title="GPT-2")),
            "its title 'GPT-2' is another family's",
        ),
        (
            (F["gpt2"], dataclasses.replace(F["llama"], slug="gpt2")),
            "its slug 'gpt2' is another family's",
        ),
        ((dataclasses.replace(F["gpt2"], name="GPT2"),), "name is lowercase letters"),
        (
            (dataclasses.replace(F["gpt2"], config="GPT2"),),
            "config names a transformers config class",
        ),
        (
            (dataclasses.replace(F["gpt2"], attn_implementations=("flash",)),),
            "are not some of ('eager', 'sdpa')",
        ),
        ((dataclasses.replace(F["gemma2"], why=""),), "why says why the family runs only some"),
        (
            (dataclasses.replace(F["llama"], why="no reason"),),
            "why says why the family runs only some",
        ),
        (
            (dataclasses.replace(F["gpt2_upcast"], diagram=True),),
            "diagram and engines need a structure",
        ),
        ((dataclasses.replace(F["bert"], engines=True),), "diagram and engines need a structure"),
        (
            (dataclasses.replace(F["gpt2"], op_graph=testing.OpGraph("x", "transformer.g.0")),),
            "op_graph needs",
        ),
        (
            (
                dataclasses.replace(
                    F["llama"], structure=_structure("llama", lm_stack="model.layer")
                ),
            ),
            "lm_stack 'model.layer' is not one of its stacks",
        ),
        (
            (dataclasses.replace(F["llama"], structure=_structure("llama", kind="decoder")),),
            "structure kind 'decoder'",
        ),
        (
            (
                dataclasses.replace(
                    F["llama"],
                    structure=_structure("llama", hidden={"model.layer": "hidden_states"}),
                ),
            ),
            "hidden names a stack the structure does not have",
        ),
        (
            (dataclasses.replace(F["t5"], structure=_structure("t5", cross_attentions={})),),
            "cross_attentions are given for exactly the stacks with a cross-attention",
        ),
        (
            (dataclasses.replace(F["bert"], structure=_structure("bert", pad=True)),),
            "pad is for decoder-only",
        ),
    ],
)
def test_a_planted_bad_family_is_refused(rows, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        testing.check_families(rows)
    assert str(info.value).startswith(f"test family {rows[-1].name!r}: ")


def test_the_registry_is_what_its_users_read():
    """Each use is a field of the rows: the suite, the zoo, the diagrams, the op graphs and the
    engine runs are the families marked for them, in the registry's order."""
    from fixtures import zoo

    assert testing.SUITE == tuple(n for n, f in F.items() if f.suite) and len(testing.SUITE) >= 2
    assert zoo.ZOO == tuple(n for n, f in F.items() if f.structure is not None)
    assert er.FAMILIES == tuple(n for n, f in F.items() if f.engines)
    assert all(
        F[n].structure.lm_stack for n in er.FAMILIES
    )  # the engines read the language-model stack
    assert all(testing.build(n).__class__.__name__ == F[n].model for n in ("gpt2", "t5"))


# -- the engines -----------------------------------------------------------------------------------

_NNSIGHT = ENGINES["nnsight"]


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            (_NNSIGHT, dataclasses.replace(ENGINES["nnterp"], title="nnsight")),
            "its title 'nnsight' is another engine's",
        ),
        (
            (_NNSIGHT, dataclasses.replace(ENGINES["nnterp"], aliases=("nnsight",))),
            "spelling 'nnsight'",
        ),
        (
            (ENGINES["transformer-lens"], dataclasses.replace(_NNSIGHT, name="transformerlens")),
            "spelling 'transformerlens'",
        ),
        ((dataclasses.replace(_NNSIGHT, name="NNsight"),), "lowercase words joined by `-`"),
        (
            (dataclasses.replace(_NNSIGHT, distribution="nn_sight"),),
            "lowercase words joined by `-`",
        ),
        (
            (dataclasses.replace(_NNSIGHT, interventions=True),),
            "intervention parity is run by an engine environment",
        ),
        (
            (dataclasses.replace(_NNSIGHT, recipe="serving.md"),),
            "recipe 'serving.md' is not a page under docs/",
        ),
    ],
)
def test_a_planted_bad_engine_is_refused(rows, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        check_engines(rows)
    assert str(info.value).startswith(f"engine {rows[-1].name!r}: ")


def _pins(path: pathlib.Path) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)$", path.read_text(), re.M))


def test_the_engine_environments_are_the_files_of_envs():
    """A row with an environment has its pins file, every file is a row's, and each row's
    distributions are pinned where it runs (its own file, or constraints.txt)."""
    assert {n for n, e in ENGINES.items() if e.environment} == {
        p.stem for p in (REPO / "envs").glob("*.txt")
    }
    main = _pins(REPO / "constraints.txt")
    for name, e in ENGINES.items():
        pins = _pins(REPO / "envs" / f"{name}.txt") if e.environment else main
        assert {"torch", *e.pinned} <= set(pins), (name, sorted(set(e.pinned) - set(pins)))
        assert e.recipe is None or (REPO / e.recipe).is_file(), e.recipe


def test_every_engine_has_a_runner_or_a_recipe():
    assert set(er.RUNNERS) == {n for n, e in ENGINES.items() if e.recipe is None}
    assert all(isinstance(e, Engine) and e.module.isidentifier() for e in ENGINES.values())


# -- the naming generations' metadata --------------------------------------------------------------

_ROWS = (Row("x", "root", "logits", "m"),)
_META = dict(heading="Made-up 2.x", slug="made-up-2x", library="made-up", checked="2.1")


@pytest.mark.parametrize(
    "generation, kwargs, message",
    [
        ("2.x", {"heading": "Made-up 2.x"}, "gives heading but not slug, library, checked"),
        ("2.x", dict(_META, checked=""), "gives heading, slug, library but not checked"),
        ("2.x", dict(_META, slug="Made up"), "slug='Made up' is not of the form"),
        ("2.x", dict(_META, library="made_up"), "library='made_up' is not of the form"),
        ("2.x", dict(_META, checked="v2.1"), "checked='v2.1' is not of the form"),
        ("2.x", dict(_META, checked="3.9"), "checked='3.9' is not a 2.x release"),
        ("2.x", {"names": "hook names"}, "names='hook names' without a heading"),
        (
            "2.x",
            dict(_META, by_kind=(("encoder-only", Table("3.x", "planted sub", _ROWS)),)),
            "its encoder-only table 'planted sub' is of generation '3.x'",
        ),
        (
            "2.x",
            dict(_META, by_kind=(("encoder-only", Table("2.x", "planted sub", _ROWS, **_META)),)),
            "its encoder-only table 'planted sub' has metadata of its own",
        ),
    ],
)
def test_planted_bad_generation_metadata_is_refused(generation, kwargs, message):
    with pytest.raises(TableError, match=re.escape(message)) as info:
        Table(generation, "planted", _ROWS, **kwargs)
    assert "'planted'" in str(info.value)


def test_good_metadata_is_accepted():
    table = Table(
        "2.x",
        "planted",
        _ROWS,
        **_META,
        names="hook names",
        by_kind=(("encoder-only", Table("2.x", "planted sub", _ROWS)),),
    )
    assert (table.heading, table.slug, table.library, table.checked) == tuple(_META.values())
    assert (
        Table("anything", "planted", _ROWS, **dict(_META, checked="0.4.1")).checked == "0.4.1"
    )  # not a series


def test_a_shipped_table_with_a_release_of_another_series_fails_at_import():
    with pytest.raises(TableError, match=re.escape("checked='3.9' is not a 4.x release")):
        dataclasses.replace(mi.GENERATIONS["4.x"], checked="3.9")


def test_every_generation_is_published_once():
    """Each generation has its own heading and page; the page is in the site's nav under that
    heading, its hand-written opening names the release the table was checked against, and the
    library is one the engine runs read (or, for 3.x, the same distribution as 2.x and 4.x)."""
    tables = list(mi.GENERATIONS.values())
    assert len({t.heading for t in tables}) == len({t.slug for t in tables}) == len(tables)
    nav = (REPO / "mkdocs.yml").read_text()
    distributions = {e.distribution for e in ENGINES.values()}
    for t in tables:
        page = REPO / "docs" / "aliases" / f"{t.slug}.md"
        intro = page.read_text().split("<!-- BEGIN GENERATED", 1)[0]
        if intro.startswith("---\n"):  # front matter (search boost) comes before the heading
            intro = intro.split("\n---\n", 1)[1].lstrip("\n")
        assert intro.startswith(f"# {t.heading}\n"), t.slug
        assert re.search(rf"\b{re.escape(t.checked)}\b", intro), (t.slug, t.checked)
        assert f"- {t.heading}: aliases/{t.slug}.md" in nav, t.slug
        assert t.library in distributions, t.library


# -- one list of each ------------------------------------------------------------------------------

#: Family spellings (keys, titles, slugs) and engine spellings (names, titles, `tool=` aliases).
FAMILY_NAMES = frozenset(F) | {f.title for f in F.values()} | {f.slug for f in F.values()}
ENGINE_NAMES = (
    frozenset(ENGINES)
    | {e.title for e in ENGINES.values()}
    | {a for e in ENGINES.values() for a in e.aliases}
)
#: A literal naming this many families (or engines) is a list of them, not a test's choice of a few.
FAMILY_LIST, ENGINE_LIST = 4, 3
#: The registries themselves.
REGISTRIES = ("tests/fixtures/engines.py",)
#: Literals that may name many families or engines, each with why it is not a second list.
ALLOWED = {
    (
        "tests/test_capture_facets.py",
        "_FACTS",
    ): "the q/k/v layouts, rope and MLP hook points each suite family's "
    "facets are rebuilt from: ground truth only this test reads",
    (
        "tests/test_grads.py",
        "",
    ): "one cross-section for the eager pattern gradients: learned positions (GPT-2), rotary "
    "grouped-query attention (Llama), softcapped scores (Gemma-2) and an encoder (BERT)",
    (
        "tests/test_derived_grads.py",
        "FAMILIES",
    ): "per family, which norm facets are derived there (LayerNorm's three on GPT-2 and BERT, "
    "RMSNorm's scale on Llama and Gemma-2) and where its output projection sits: ground truth "
    "only this test reads, the same cross-section as test_grads'",
    (
        "tests/test_why_page.py",
        "PEERS",
    ): "the libraries the Why TorchLens page sets beside TorchLens, upstream TorchLens among "
    "them (no engine the runs read): the page's column headers",
    (
        "tests/test_diagnosis.py",
        "PATHS",
    ): "norm and projection addresses of the softcap/residual diagnosis "
    "models, most of them variants the registry does not hold",
    (
        "tests/_edge_models.py",
        "CONFIGS",
    ): "the edge architectures of issue 22, with five registry families in "
    "variant configs (special tokens, 32 positions); to be folded into "
    "the registry as rows or build(name, **settings)",
    (
        "tests/fixtures/engine_runs.py",
        "RUNNERS",
    ): "code, one runner per engine; its keys are checked against "
    "the rows when the module is imported",
}


def second_lists(path: pathlib.Path, source: str) -> list[str]:
    """The literals of `source` (a tuple, list, set, or a dict's keys) that name `FAMILY_LIST`
    families or `ENGINE_LIST` engines, as `path:line (assigned name): names`, less `ALLOWED`."""
    tree = ast.parse(source)
    targets: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name):
                for sub in ast.walk(node.value):
                    targets.setdefault(id(sub), target.id)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        words = {
            item.value
            for item in items
            if isinstance(item, ast.Constant) and isinstance(item.value, str)
        }
        for names, limit in (
            (words & FAMILY_NAMES, FAMILY_LIST),
            (words & ENGINE_NAMES, ENGINE_LIST),
        ):
            name = targets.get(id(node), "")
            if len(names) >= limit and (str(path), name) not in ALLOWED:
                out.append(f"{path}:{node.lineno} ({name or 'unnamed'}): {sorted(names)}")
    return out


def test_no_second_list_of_families_or_engines():
    found = []
    for path in sorted([*(REPO / "tests").rglob("*.py"), *(REPO / "scripts").rglob("*.py")]):
        rel = path.relative_to(REPO)
        if str(rel) not in REGISTRIES:
            found += second_lists(rel, path.read_text())
    assert not found, (
        "literal lists of families or engines outside their registries (read "
        "torchlens.testing.FAMILIES or fixtures.engines.ENGINES instead):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "source, hit",
    [
        ("DIAGRAMS = ('gpt2', 'llama', 'gpt_neox', 'qwen3')\n", "x.py:1 (DIAGRAMS)"),
        ("TITLES = {'GPT-2': 1, 'Llama': 2, 'Qwen3': 3, 'Gemma-2': 4}\n", "x.py:1 (TITLES)"),
        ("def f():\n    return ['gemma-2', 'phi-3', 'olmo-2', 'gpt2']\n", "x.py:2 (unnamed)"),
        ("NAMES = {'nnsight': 'a', 'nnterp': 'b', 'vllm': 'c'}\n", "x.py:1 (NAMES)"),
        (
            "_FACTS = {'nnsight': 1, 'vLLM': 2, 'transformerlens': 3}\n",
            "x.py:1 (_FACTS)",
        ),  # allowed only by path
    ],
)
def test_a_planted_second_list_is_found(source, hit):
    found = second_lists(pathlib.Path("x.py"), source)
    assert len(found) == 1 and found[0].startswith(hit), found


def test_a_few_families_are_a_choice_not_a_list():
    assert (
        second_lists(
            pathlib.Path("x.py"),
            "CONFIGS = [('gpt2', 'eager'), ('llama', 'sdpa'), ('t5', 'eager')]\n"
            "PAIR = ('nnsight', 'nnterp')\n",
        )
        == []
    )
