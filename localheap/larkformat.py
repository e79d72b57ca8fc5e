"""A custom tool's Lark `format` (Responses API) as the grammar of the call that writes its input.
The model writes that input inside the call's JSON string (`{"input": "..."}`), so a grammar holds it
only as JSON escapes it: a Lark grammar whose rules do not recurse is spelled out as one regular
expression (llguidance escapes a JSON string's `pattern` itself); any other is rewritten rule by rule,
each terminal as the strings JSON writes for it, its `%ignore` spelled out between terminals. Knows
Lark's syntax and JSON's string escapes, not the tool-call families (server/chat.py places the rules)."""

from __future__ import annotations

import json
import re
from functools import lru_cache

from .grammar import GrammarError

try:   # Python's own reader of regular expressions (the tree it compiles from)
    from re import _constants as _sc, _parser as _sp
except ImportError:   # pragma: no cover (Python < 3.11)
    import sre_constants as _sc   # type: ignore[no-redef]
    import sre_parse as _sp   # type: ignore[no-redef]

_COMMON = {   # Lark's `%import common.NAME` terminals this understands
    "LF": r"\n", "CR": r"\r", "NEWLINE": r"(?:\r?\n)+", "WS": r"[ \t\f\r\n]+", "WS_INLINE": r"[ \t]+",
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[0-9a-fA-F]", "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"(?:[0-9]+\.[0-9]*|\.[0-9]+)", "FLOAT": r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?",
    "NUMBER": r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?",
    "SIGNED_NUMBER": r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?",
    "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]", "LETTER": r"[A-Za-z]", "WORD": r"[A-Za-z]+",
    "CNAME": r"[_A-Za-z][_A-Za-z0-9]*", "ESCAPED_STRING": r'"(?:[^"\\]|\\.)*"',
}
_LARK_TOKEN = re.compile(r'''
    (?P<ws>[ \t\r]+|//[^\n]*|\#[^\n]*|\n[ \t]*(?=\|))   # spaces, comments, a newline before a continued rule
  | (?P<nl>\n)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<directive>%[a-z]+[^\n]*)
  | (?P<name>[?!]?[_A-Za-z][_A-Za-z0-9]*(?:\.-?[0-9]+)?)
  | (?P<number>[0-9]+)
  | (?P<op>->|\.\.|[:|()\[\]?*+~,])
  | (?P<braces>\{[0-9]*(?:,[0-9]*)?\})                # llguidance's x{M,N} for x~M..N
''', re.X)
_META = set("\\.+*?()|[]{}^$#&-~")
_LARK_LIMIT = 1 << 16   # characters of the spelled-out expression (a rule used many times is copied each time)


def _lark_literal(token: str) -> str:
    """A Lark string token as a regular expression (its `i` flag as `(?i:...)`)."""
    text, insensitive = _literal_text(token)
    body = "".join("\\" + c if c in _META else {"\n": r"\n", "\t": r"\t", "\r": r"\r"}.get(c, c) for c in text)
    return f"(?i:{body})" if insensitive else body


def _literal_text(token: str) -> tuple[str, bool]:
    """A Lark string token's text, and whether it has the `i` flag."""
    insensitive = token.endswith("i") and not token.endswith('"')
    try:
        return json.loads(token[:-1] if insensitive else token), insensitive
    except ValueError as e:
        raise GrammarError(f"the Lark grammar's string {token} cannot be read") from e


def _lark_statements(text: str) -> tuple[dict[str, list], list[list]]:
    """(name -> its definition's tokens, the token lists of its %ignore lines); %import common.X
    names the terminals above."""
    rules: dict[str, list] = {}
    ignores: list[list] = []
    for st in _token_lines(text):
        if st[0][0] == "directive":
            words = st[0][1].split()
            if words[0] == "%import" and len(words) >= 2 and words[1].startswith("common."):
                names = words[1][len("common."):].strip("()").split(",") + words[2:]
                for name in (n.strip() for n in names if n.strip() not in ("", "->")):
                    if name not in _COMMON:
                        raise GrammarError(f"the Lark grammar imports {name!r}, which this server does not know")
                    rules[name] = [("regex", "/" + _COMMON[name] + "/")]
                if "->" in words:   # %import common.X -> ALIAS
                    rules[words[-1]] = rules.pop(words[-3].split(".")[-1])
                continue
            if words[0] == "%ignore" and len(words) >= 2:
                (line,) = _token_lines(st[0][1][len("%ignore"):])
                ignores.append(line)
                continue
            raise GrammarError(f"the Lark grammar uses {words[0]}, which this server does not read")
        if len(st) < 2 or st[0][0] != "name" or st[1] != ("op", ":"):
            raise GrammarError(f"the Lark grammar has a line that is not a rule: {' '.join(t for _, t in st)[:60]!r}")
        rules[st[0][1].lstrip("?!").split(".")[0]] = st[2:]
    if "start" not in rules:
        raise GrammarError("the Lark grammar has no `start` rule")
    return rules, ignores


def _token_lines(text: str) -> list[list]:
    """The grammar's tokens, (kind, text), a list per statement."""
    statement: list = []
    statements = [statement]
    at = 0
    while at < len(text):
        m = _LARK_TOKEN.match(text, at)
        if m is None:
            raise GrammarError(f"the Lark grammar cannot be read at {text[at:at + 20]!r}")
        at = m.end()
        kind = m.lastgroup
        if kind == "ws":
            continue
        if kind == "nl":
            statement = []
            statements.append(statement)
            continue
        statement.append((kind, m.group()))
    return [st for st in statements if st]


def lark_regex(text: str) -> str:
    """One regular expression (Rust `regex` syntax, as llguidance reads it) for the strings a Lark
    grammar without recursion accepts from `start`. GrammarError for what it cannot spell out."""
    rules, ignores = _lark_statements(text)
    if ignores:
        raise GrammarError("the Lark grammar uses %ignore, which cannot be spelled out as one expression")
    done: dict[str, str] = {}

    def name(n: str, stack: tuple) -> str:
        if n in stack:
            raise GrammarError(f"the Lark grammar's rule {n!r} recurses: not one regular expression")
        if n not in done:
            if n not in rules:
                raise GrammarError(f"the Lark grammar uses {n!r}, which it does not define")
            done[n] = whole(rules[n], stack + (n,))
        return done[n]

    def whole(tokens: list, stack: tuple) -> str:
        out, at = alternatives(tokens, 0, stack)
        if at != len(tokens):
            raise GrammarError(f"the Lark grammar cannot be read at {tokens[at][1]!r}")
        return out

    def alternatives(tokens: list, at: int, stack: tuple) -> tuple[str, int]:
        alts = []
        while True:
            seq, at = sequence(tokens, at, stack)
            if at < len(tokens) and tokens[at] == ("op", "->"):   # an alias names the tree node only
                at += 2
            alts.append(seq)
            if at < len(tokens) and tokens[at] == ("op", "|"):
                at += 1
                continue
            out = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
            if len(out) > _LARK_LIMIT:
                raise GrammarError("the Lark grammar spelled out as one expression is too long")
            return out, at

    def sequence(tokens: list, at: int, stack: tuple) -> tuple[str, int]:
        parts = []
        while at < len(tokens) and tokens[at] not in (("op", "|"), ("op", ")"), ("op", "]"), ("op", "->")):
            atom, at = item(tokens, at, stack)
            parts.append(atom)
        return "".join(parts), at

    def item(tokens: list, at: int, stack: tuple) -> tuple[str, int]:
        kind, tok = tokens[at]
        at += 1
        if (kind, tok) in (("op", "("), ("op", "[")):
            inner, at = alternatives(tokens, at, stack)
            close = ")" if tok == "(" else "]"
            if at >= len(tokens) or tokens[at] != ("op", close):
                raise GrammarError(f"the Lark grammar misses a {close!r}")
            at += 1
            atom = f"(?:{inner})" + ("?" if tok == "[" else "")
        elif kind == "string":
            atom = _lark_literal(tok)
            if at + 1 < len(tokens) and tokens[at] == ("op", "..") and tokens[at + 1][0] == "string":
                atom, at = f"[{atom}-{_lark_literal(tokens[at + 1][1])}]", at + 2   # "a".."z"
            else:
                atom = f"(?:{atom})"
        elif kind == "regex":
            body, flags = tok[1:].rsplit("/", 1)
            body = body.replace("\\/", "/")
            atom = f"(?{flags}:{body})" if flags else f"(?:{body})"
        elif kind == "name":
            atom = f"(?:{name(tok.lstrip('?!'), stack)})"
        else:
            raise GrammarError(f"the Lark grammar cannot be read at {tok!r}")
        if at < len(tokens) and tokens[at][0] == "op" and tokens[at][1] in "?*+":
            atom, at = atom + tokens[at][1], at + 1
        elif at < len(tokens) and tokens[at][0] == "braces":
            atom, at = atom + tokens[at][1].replace("{,", "{0,"), at + 1
        elif at + 1 < len(tokens) and tokens[at] == ("op", "~") and tokens[at + 1][0] == "number":
            lo = tokens[at + 1][1]
            if at + 3 < len(tokens) and tokens[at + 2] == ("op", "..") and tokens[at + 3][0] == "number":
                atom, at = atom + f"{{{lo},{tokens[at + 3][1]}}}", at + 4
            else:
                atom, at = atom + f"{{{lo}}}", at + 2
        return atom, at

    return name("start", ())


# --- any Lark grammar, rule by rule, as JSON writes its strings ----------------------------------
# Each terminal (a string, a regular expression, a common import) becomes the strings JSON writes for
# the strings it matches, each character as json.dumps escapes it (`"` `\` and controls escaped, the
# rest as they are); rules keep their shape, renamed under a prefix to sit beside the call's own.

_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_SPECIALS = ['"', "\\"] + [chr(i) for i in range(0x20)]   # the characters JSON writes escaped
_PLAIN = r'[^"\\\x00-\x1f]'                                # (the others, as a class in both dialects)
_FLAGS = {"i": _sc.SRE_FLAG_IGNORECASE, "s": _sc.SRE_FLAG_DOTALL, "m": _sc.SRE_FLAG_MULTILINE,
          "x": _sc.SRE_FLAG_VERBOSE, "u": 0, "l": 0}
_CATEGORIES = {_sc.CATEGORY_DIGIT: r"\d", _sc.CATEGORY_NOT_DIGIT: r"\D", _sc.CATEGORY_SPACE: r"\s",
               _sc.CATEGORY_NOT_SPACE: r"\S", _sc.CATEGORY_WORD: r"\w", _sc.CATEGORY_NOT_WORD: r"\W"}
_REPEATS = tuple(getattr(_sc, n) for n in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(_sc, n))


def _json_char(c: str) -> str:
    return _ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 else c)


def _rx(text: str) -> str:
    """`text` literally, as a regular expression."""
    return "".join("\\" + c if c in _META else c for c in text)


def _in_class(c: str) -> str:
    """One character inside a class, in a spelling Python and Rust's regex read alike."""
    if c.isalnum() and c.isascii() or c in " !\"#%',:;=@_`{}<>":
        return c
    return "\\" + c if c in "\\]^-[&~.$*+?()|" else f"\\U{ord(c):08x}"


@lru_cache(maxsize=1)
def _plain_chars() -> str:
    """Every character JSON writes as it is (but surrogates), to ask a class whether it holds one."""
    spans = ((0x20, 0x22), (0x23, 0x5C), (0x5D, 0xD800), (0xE000, 0x110000))   # (not " \\ or surrogates)
    return "".join("".join(map(chr, range(a, b))) for a, b in spans)


def json_regex(body: str, flags: str = "") -> str:
    """A regular expression (Rust `regex` syntax, as llguidance reads it) for the strings JSON writes
    for those `body` (Lark's regex dialect, with Lark's flags) matches. GrammarError for what it cannot
    rewrite: anchors, lookarounds, backreferences."""
    tree, flags_in = _parse(body, flags)
    return _Rewrite(False).seq(tree, flags_in)


def _parse(body: str, flags: str) -> tuple:
    try:
        tree = _sp.parse(body, sum(_FLAGS[c] for c in flags))
    except (re.error, KeyError) as e:
        raise GrammarError(f"the regular expression /{body}/ cannot be read here: {e}") from e
    return tree, tree.state.flags


def _class_of(op, av) -> str:
    """A one-character node (not a literal) as a class, in a spelling Python and Rust's regex read alike."""
    if op is _sc.NOT_LITERAL:
        return f"[^{_in_class(chr(av))}]"
    negate = bool(av) and av[0][0] is _sc.NEGATE
    parts = []
    for kind, value in av[negate:]:
        if kind is _sc.LITERAL:
            parts.append(_in_class(chr(value)))
        elif kind is _sc.RANGE:
            parts.append(_in_class(chr(value[0])) + "-" + _in_class(chr(value[1])))
        elif kind is _sc.CATEGORY and value in _CATEGORIES:
            parts.append(_CATEGORIES[value])
        else:
            raise GrammarError(f"a class in the grammar's regular expressions uses {kind}, "
                               "which this server does not read")
    return "[" + "^" * negate + "".join(parts) + "]"


@lru_cache(maxsize=1024)
def _split(cls: str, flags: int) -> tuple[bool, tuple[str, ...]]:
    """Whether class `cls` holds characters JSON writes as they are, and which it writes escaped
    (remembered: each class is asked whether it is risky, then rewritten)."""
    python = re.compile(cls, re.IGNORECASE if flags & _sc.SRE_FLAG_IGNORECASE else 0)
    return bool(python.search(_plain_chars())), tuple(c for c in _SPECIALS if python.match(c))


class _Rewrite:
    """A regular expression's tree (Python's reader), rewritten for the strings JSON writes for what it
    matches: as one regular expression, or (`rules`) as a Lark rule body whose lexemes are one character
    or one escape each. (llguidance's lexer looks one byte past a lexeme's end: a lexeme that could go
    on with an escape cannot end where the next one begins with a backslash, as after a space `\n` or
    `\"`. A terminal that repeats what JSON escapes is written as rules for that.)"""

    def __init__(self, rules: bool):
        self.rules = rules

    def seq(self, items, flags: int) -> str:
        return (" " if self.rules else "").join(p for p in (self.node(op, av, flags) for op, av in items) if p)

    def node(self, op, av, flags: int) -> str:
        if op is _sc.LITERAL:
            c = chr(av)
            fold = _json_char(c) == c and flags & _sc.SRE_FLAG_IGNORECASE and c.lower() != c.upper()
            if self.rules:
                return json.dumps(_json_char(c), ensure_ascii=False) + "i" * bool(fold)
            return f"(?i:{_rx(c)})" if fold else _rx(_json_char(c))
        if op is _sc.ANY:
            return self.one(r"[\s\S]" if flags & _sc.SRE_FLAG_DOTALL else r"[^\n]", flags)
        if op in (_sc.NOT_LITERAL, _sc.IN):
            return self.one(_class_of(op, av), flags)
        if op is _sc.BRANCH:
            alts = [self.seq(branch, flags) for branch in av[1]]
            if not self.rules:
                return "(?:" + "|".join(alts) + ")"
            full = [a for a in alts if a]
            return ("[{}]" if len(full) < len(alts) else "{}").format("(" + " | ".join(full) + ")")
        if op is _sc.SUBPATTERN:
            _, add, remove, inner = av
            inner = self.seq(inner, (flags | add) & ~remove)
            return (f"({inner})" if inner else "") if self.rules else f"(?:{inner})"
        if op in _REPEATS:
            lo, hi, inner = av
            many = hi == _sc.MAXREPEAT
            inner = self.seq(inner, flags)
            if self.rules and (not inner or hi == 0):
                return ""
            if many and lo < 2 or (lo, hi) == (0, 1):
                q = "?" if not many else "*+"[lo]
            elif self.rules:   # (Lark's x~M..N; no open bound: M of them, then any more)
                q = f"~{lo} ({inner})*" if many else f"~{lo}" if lo == hi else f"~{lo}..{hi}"
            else:
                q = f"{{{lo},}}" if many else f"{{{lo},{hi}}}"
            return f"({inner}){q}" if self.rules else f"(?:{inner}){q}"
        raise GrammarError(f"the grammar's regular expressions use {str(op).lower()}, which this server does not "
                           "rewrite for a JSON string (anchors, lookarounds and backreferences)")

    def one(self, cls: str, flags: int) -> str:
        """One character of class `cls`: the ones JSON writes as they are, then each escaped one."""
        plain, specials = _split(cls, flags)
        if self.rules:
            alts = [json.dumps(_json_char(c)) for c in specials]
        else:
            alts = [_rx(_json_char(c)) for c in specials]
        if plain:
            rx = f"[{cls}&&{_PLAIN}]" if specials else cls   # (a class without escaped characters as it is)
            rx = f"(?i:{rx})" if flags & _sc.SRE_FLAG_IGNORECASE else rx
            alts.insert(0, "/" + rx.replace("/", "\\/") + "/" if self.rules else rx)
        if not alts:
            raise GrammarError(f"the class {cls} matches nothing")
        if len(alts) == 1:
            return alts[0]
        return "(" + " | ".join(alts) + ")" if self.rules else "(?:" + "|".join(alts) + ")"


def _goes_on_escaped(items, flags: int, repeated: bool = False) -> bool:
    """Whether a repeat (or an option) in the tree can match a character JSON escapes: as one lexeme,
    its escaped form could go on after a point where it could end."""
    for op, av in items:
        if op in _REPEATS:
            if _goes_on_escaped(av[2], flags, repeated or av[0] != av[1]):
                return True
        elif op is _sc.BRANCH:
            if any(_goes_on_escaped(branch, flags, repeated) for branch in av[1]):
                return True
        elif op is _sc.SUBPATTERN:
            if _goes_on_escaped(av[3], (flags | av[1]) & ~av[2], repeated):
                return True
        elif repeated and op is _sc.LITERAL:
            if _json_char(chr(av)) != chr(av):
                return True
        elif repeated and op in (_sc.NOT_LITERAL, _sc.IN, _sc.ANY):
            if op is _sc.ANY or _split(_class_of(op, av), flags)[1]:
                return True
    return False


def _terminal(name: str) -> bool:
    return name.upper() == name


def lark_rules(text: str, top: str, json_string: bool = True) -> str:
    """Lark rules (llguidance's dialect) whose rule `top` takes what the Lark grammar `text` takes
    from `start`: as JSON writes it inside a string (json_string), or as it is; its names prefixed by
    `top`; its %ignore spelled out as optional terminals after each terminal. Lines, no final newline."""
    rules, ignores = _lark_statements(text)
    trees = {}   # a regex token -> its tree and flags (json_string)

    def tree(token: str) -> tuple:
        if token not in trees:
            body, flags = token[1:].rsplit("/", 1)
            trees[token] = _parse(body.replace("\\/", "/"), flags)
        return trees[token]

    def written_as_rules(tokens: list) -> bool:
        """Whether a terminal's definition (or %ignore's) is written as rules: a regex in it could go
        on with an escape, or it names a terminal written so."""
        return json_string and any(kind == "regex" and _goes_on_escaped(*tree(tok)) or
                                   kind == "name" and tok in as_rules for kind, tok in tokens)

    as_rules: set = set()
    while more := {n for n in rules if _terminal(n) and n not in as_rules and written_as_rules(rules[n])}:
        as_rules |= more
    ignore = None
    if ignores:
        ignore = f"{top}_ignored" if any(written_as_rules(tokens) for tokens in ignores) else f"{top.upper()}_IGNORED"

    def rename(n: str) -> str:
        if n not in rules:
            raise GrammarError(f"the Lark grammar uses {n!r}, which it does not define")
        if n in as_rules:
            return f"{top}_tok_{n.lower()}"
        return f"{top.upper()}_{n}" if _terminal(n) else f"{top}_{n}"

    def string(token: str, as_rule: bool) -> str:
        text, insensitive = _literal_text(token)
        if not json_string:
            return token
        if not insensitive:
            return json.dumps("".join(_json_char(c) for c in text), ensure_ascii=False)
        flags = _sc.SRE_FLAG_IGNORECASE
        if as_rule:
            return "(" + " ".join(_Rewrite(True).node(_sc.LITERAL, ord(c), flags) for c in text) + ")"
        return "/" + "".join(_Rewrite(False).node(_sc.LITERAL, ord(c), flags) for c in text).replace("/", "\\/") + "/"

    def regex(token: str, as_rule: bool) -> str:
        if not json_string:
            return token
        items, flags = tree(token)
        if as_rule or _goes_on_escaped(items, flags):
            return "(" + _Rewrite(True).seq(items, flags) + ")"
        return "/" + _Rewrite(False).seq(items, flags).replace("/", "\\/") + "/"

    def body(tokens: list, terminal: bool, as_rule: bool) -> str:
        """A definition's tokens rewritten: inside a terminal (`terminal`) no ignored text between them."""
        out, at = [], 0
        while at < len(tokens):
            kind, tok = tokens[at]
            at += 1
            if (kind, tok) == ("op", "->"):   # an alias names the tree's node only
                at += 1
                continue
            ranged = at + 1 < len(tokens) and tokens[at] == ("op", "..") and tokens[at + 1][0] == "string"
            if kind == "string" and ranged:
                lo, hi = _literal_text(tok)[0], _literal_text(tokens[at + 1][1])[0]
                if len(lo) != 1 or len(hi) != 1:
                    raise GrammarError(f"the Lark grammar's range {tok}..{tokens[at + 1][1]} is not of characters")
                atom, at = regex(f"/[{_in_class(lo)}-{_in_class(hi)}]/", as_rule), at + 2
            elif kind == "string":
                atom = string(tok, as_rule)
            elif kind == "regex":
                atom = regex(tok, as_rule)
            elif kind == "name":
                atom = rename(tok.lstrip("?!"))
                if not _terminal(tok.lstrip("?!")):
                    out.append(atom)
                    continue
            elif kind in ("op", "number", "braces"):
                out.append(tok)
                continue
            else:
                raise GrammarError(f"the Lark grammar uses {tok[:20]!r} in a rule, which this server does not rewrite")
            out.append(f"({atom} {ignore}*)" if ignore and not terminal else atom)
        return " ".join(out)

    lines = [f"{top}: {ignore + '* ' if ignore else ''}{rename('start')}"]
    if ignore:
        lines.append(f"{ignore}: " + " | ".join(body(tokens, True, ignore.islower()) for tokens in ignores))
    for name, tokens in rules.items():
        lines.append(f"{rename(name)}: {body(tokens, _terminal(name), name in as_rules)}")
    return "\n".join(lines)


class LarkInput(dict):
    """The schema of a custom tool's `{"input": ...}` whose string the Lark grammar `lark` holds, where
    one regular expression cannot: the tool-call grammars write out its rules (lark_rules) in place of
    a `%json` rule. (A type of its own, so no schema a client sends can ask for it.)"""

    def __init__(self, schema: dict, lark: str):
        super().__init__(schema)
        self.lark = lark
