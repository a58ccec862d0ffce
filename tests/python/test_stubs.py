"""The type stubs of the native module (kvwire/_kvwire.pyi) declare every public name it has,
class by class, and ship in the package with py.typed (and the exceptions' errors.pyi)."""

import ast
import pathlib

import kvwire
import kvwire._kvwire as native

STUB = pathlib.Path(native.__file__).with_name("_kvwire.pyi")


def _public(names):
    return {n for n in names if not n.startswith("_")}


def _names(body):
    """Top-level names of a module or class body: classes, functions, annotated or assigned."""
    out = {}
    for node in body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = _names(node.body)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = None
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = None
    return out


def _stub():
    return _names(ast.parse(STUB.read_text(encoding="utf-8")).body)


def test_stubs_and_py_typed_ship_in_the_package():
    assert STUB.is_file(), STUB
    pkg = pathlib.Path(kvwire.__file__).parent
    assert (pkg / "py.typed").is_file()
    assert (pkg / "errors.pyi").is_file()


def test_the_stubs_list_every_public_name_of_the_native_module():
    stub = _stub()
    assert _public(dir(native)) == _public(stub)
    assert "__version__" in stub


def test_each_stub_class_lists_every_public_member():
    for name, members in _stub().items():
        if members is None:
            continue
        cls = getattr(native, name)
        have = _public(dir(cls)) - _public(dir(object))
        assert have == _public(members), name


def test_action_classes_match_positionally_as_the_stubs_say():
    tree = ast.parse(STUB.read_text(encoding="utf-8"))
    declared = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__match_args__" for t in item.targets
                ):
                    declared[node.name] = ast.literal_eval(item.value)
    assert len(declared) == 11
    for name, fields in declared.items():
        assert getattr(native, name).__match_args__ == fields, name
    d = native.DCore("lazy", 2)
    d.arrived(1, 0, 32, 2, 0)
    match d.poll_actions()[0]:
        case native.Send(peer, data):
            assert peer == 0 and isinstance(data, bytes)
        case other:
            raise AssertionError(other)
