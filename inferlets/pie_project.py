"""A Pie 0.4 inferlet project: ``Pie.toml`` (``[package]``, ``[parameters]``) beside a
``main.py`` with ``async def main(input: dict) -> str``; and the input check its
``[parameters]`` table promises (types ``string`` / ``int`` / ``float`` / ``bool`` /
``object`` / ``array``, ``optional = true``)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from media.errors import InvalidRequestError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "str": (str,),
    "int": (int,),
    "integer": (int,),
    "float": (int, float),
    "number": (int, float),
    "bool": (bool,),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "list": (list,),
}


class PieManifestError(InvalidRequestError):
    code = "invalid_pie_manifest"


class PieInputError(InvalidRequestError):
    """The input JSON does not fit the program's ``[parameters]``."""

    code = "invalid_inferlet_input"


@dataclass(frozen=True)
class Parameter:
    name: str
    type: str
    optional: bool = False
    description: str = ""


@dataclass(frozen=True)
class PieManifest:
    name: str
    version: str
    description: str = ""
    parameters: dict[str, Parameter] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @classmethod
    def parse(cls, text: str) -> PieManifest:
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise PieManifestError(f"Pie.toml is not valid TOML: {e}") from None
        pkg = doc.get("package")
        if not isinstance(pkg, dict):
            raise PieManifestError("Pie.toml has no [package] table (name, version)")
        name, version = pkg.get("name"), pkg.get("version")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise PieManifestError(f"[package].name must be a lower-case name, got {name!r}")
        if not isinstance(version, str) or not version.strip():
            raise PieManifestError(f"[package].version must be a string, got {version!r}")
        params: dict[str, Parameter] = {}
        table = doc.get("parameters", {})
        if not isinstance(table, dict):
            raise PieManifestError("[parameters] must be a table of name = {type = ...}")
        for pname, spec in table.items():
            if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
                raise PieManifestError(f"parameter {pname!r} needs a type (string, int, float, bool, ...)")
            ptype = spec["type"].lower()
            if ptype not in TYPES:
                raise PieManifestError(
                    f"parameter {pname!r} has unknown type {spec['type']!r}; known: {sorted(TYPES)}"
                )
            params[pname] = Parameter(
                pname, ptype, bool(spec.get("optional", False)), str(spec.get("description", ""))
            )
        return cls(name, version.strip(), str(pkg.get("description", "")), params, doc)

    @classmethod
    def load(cls, project: Path) -> PieManifest:
        path = Path(project) / "Pie.toml"
        if not path.is_file():
            raise PieManifestError(f"{project} has no Pie.toml")
        return cls.parse(path.read_text(encoding="utf-8"))

    def check_input(self, data: Any) -> None:
        """Raise ``PieInputError`` unless ``data`` (the decoded input JSON) fits ``[parameters]``:
        an object, every required parameter present, each present one of its type. Names the
        manifest does not list pass (Pie's runtime hands the whole object to ``main``)."""
        if not isinstance(data, dict):
            raise PieInputError(f"{self.ref} takes a JSON object as input, got {type(data).__name__}")
        for p in self.parameters.values():
            if p.name not in data or data[p.name] is None:
                if not p.optional:
                    raise PieInputError(
                        f"{self.ref} needs the parameter {p.name!r} ({p.type})", parameter=p.name
                    )
                continue
            v = data[p.name]
            ok = isinstance(v, TYPES[p.type]) and not (isinstance(v, bool) and bool not in TYPES[p.type])
            if not ok:
                raise PieInputError(
                    f"{self.ref}: parameter {p.name!r} must be {p.type}, got {type(v).__name__}",
                    parameter=p.name,
                )


def is_pie_project(path: Path) -> bool:
    path = Path(path)
    return (path / "Pie.toml").is_file() and (path / "main.py").is_file()
