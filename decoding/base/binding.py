"""A module's linear layers bound beside it (:class:`Binding`): each ``nn.Linear`` wears
:class:`PackedLinear` as its class only inside the decoder's own forwards
(:func:`packed_forward`), where its product takes the path the plan picks (:mod:`.plan`,
through the copies of :mod:`.packed`, or its slice of a :class:`~.siblings.SiblingProduct`).
Nothing of it lives in the module: between forwards the model the user holds is exactly the one
they built."""
from __future__ import annotations

import contextvars
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from ...core.content import FingerprintMemo
from .packed import PackedWeight, block_kind, packed_matmul, resolved_matmul
from .plan import PACKED_DTYPES, packing_available, packs
from .rows import subset_product
from .siblings import SiblingProduct, sibling_groups

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("draftheads_packed_linears", default=False)


@dataclass(eq=False)
class BoundLinear:
    """What draftheads keeps for one of a module's ``nn.Linear`` layers: its copies and, where it
    has siblings (:data:`~.siblings.SIBLINGS`), its slice of their one product."""

    module: nn.Linear
    copies: PackedWeight = field(default_factory=PackedWeight)
    siblings: "tuple[SiblingProduct, int] | None" = None


#: the bound linears of the bindings now entered (:meth:`Binding.enter`), by ``id`` of the module
#: (held by its binding while listed, so the id is its own)
_LIVE: dict[int, BoundLinear] = {}
_WEAR_LOCK = threading.Lock()


class PackedLinear(nn.Linear):
    """The class a bound ``nn.Linear`` wears while its binding is entered (inside the decoder's
    forwards), and only then: the same object, parameters, hooks and ``__dict__``; its product
    through the packed oneDNN primitive, the few-row kernel or its slice of its siblings' one
    product (:class:`SiblingProduct`), whichever the plan picks, while :func:`packed_linears` is
    active in this thread; ``F.linear`` otherwise (another thread's call sees the plain layer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return subset_product(x, self.in_features, self._product)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        bound = _LIVE.get(id(self)) if _ACTIVE.get() and stands_in(self) else None
        if bound is not None and x.dtype == self.weight.dtype:
            rows = x.numel() // self.in_features
            if bound.siblings is not None and bound.siblings[0].pays(rows):
                return bound.siblings[0].output(bound.siblings[1], x)
            if packs(self.weight, rows, block_kind(bound.copies, self.weight)):
                return packed_matmul(x, self.weight, bound.copies, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)


def global_hooks() -> bool:
    """Whether a forward hook or pre-hook is registered for every module of the process."""
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


#: where transformers defines the forward hooks it installs itself on first ``output_hidden_states``
#: / ``output_attentions`` (``install_output_capuring_hook``): they only record what passes, and
#: only inside a forward that asked for it, so they change nothing a caller sees
_CAPTURING_HOOKS = "transformers.utils.output_capturing"


def callers_hook(module: nn.Module) -> bool:
    """Whether ``module`` carries a forward hook or pre-hook of the caller's (``with_kwargs`` and
    ``always_call`` ones live in the same tables; transformers' output-capturing hooks do not count)."""
    if module._forward_pre_hooks:
        return True
    return bool(module._forward_hooks) and any(getattr(hook, "__module__", None) != _CAPTURING_HOOKS
                                                for hook in module._forward_hooks.values())


def stands_in(module: nn.Module) -> bool:
    """Whether a draftheads product may be computed in place of calling ``module``: a plain
    ``nn.Linear`` (the class it is or wears, not a subclass: a parametrized layer is one) whose
    weight is its own parameter (not weight norm's recomputed attribute), carrying no forward hook
    or pre-hook, with none registered for every module. Otherwise the module is called as the
    model calls it. Read at each product: a few attribute reads."""
    return (type(module) in (nn.Linear, PackedLinear) and "weight" in module._parameters
            and not module._forward_hooks and not module._forward_pre_hooks and not global_hooks())


def _wear(module: nn.Module, cls: type) -> None:
    # object.__setattr__: nn.Module.__setattr__ would first look the name up among parameters,
    # buffers and submodules (slower, and a bound model has hundreds of linears)
    object.__setattr__(module, "__class__", cls)


def _layout(root: nn.Module) -> tuple:
    """The plain ``nn.Linear`` layers below ``root`` as (id, dtype, device, shape, has bias): a
    binding made for another layout is remade (a layer replaced, cast, moved or wrapped by peft)."""
    return tuple((id(m), m.weight.dtype, m.weight.device, tuple(m.weight.shape), m.bias is None)
                 for m in root.modules() if type(m) is nn.Linear)


class Binding:
    """Everything draftheads keeps for one module's linear layers, beside the module, never in it:
    each layer's copies and sibling products (:class:`BoundLinear`). Between the decoder's
    forwards the module is exactly as its owner built it — type, ``__dict__``, state dict,
    hooks — so ``copy.deepcopy``, ``pickle``, ``torch.save`` and type-based module search
    (``quantize_dynamic``, peft's ``target_modules``) see nothing of draftheads.

    Inside (:meth:`enter` … :meth:`exit`, refcounted across threads and nested uses) each plain
    ``nn.Linear`` wears :class:`PackedLinear` as its ``__class__`` and is restored on exit. Why
    this and not a wrapper module: a wrapper put in the model's place is what deepcopy, pickle and
    quantizers then find; a class swap touches no attribute, costs two pointer writes per layer
    per entry, and a decoding call enters once for all its forwards (:func:`packed_forward` is then a refcount)."""

    def __init__(self) -> None:
        self.linears: dict[int, BoundLinear] = {}
        self.products: list[SiblingProduct] = []
        self.fused = False
        self._layout: tuple = ()
        self._users = 0
        self._worn: list[nn.Linear] = []
        #: bumped when a layer or a copy changes (what resolved products, :mod:`.direct`, compare)
        self.generation = 0

    def rescan(self, root: nn.Module) -> bool:
        """Follow ``root``'s layers as they are now (outside :meth:`enter` only): layers kept keep
        their copies, new ones get theirs, gone ones are released. Returns whether anything changed."""
        if self._users:  # entered: its layers wear another class until the last user leaves
            return False
        layout = _layout(root)
        if layout == self._layout:
            return False
        previous = self.linears
        self.linears = {}
        for m in root.modules():
            if type(m) is nn.Linear:
                kept = previous.get(id(m))
                self.linears[id(m)] = BoundLinear(m, kept.copies if kept is not None else PackedWeight())
        self._layout = layout
        self.products = []
        self.generation += 1
        if self.fused:
            self.fuse(root)
        return True

    def fuse(self, root: nn.Module) -> list[SiblingProduct]:
        """Give every sibling group of bound layers under ``root`` (:func:`sibling_groups`) one
        :class:`SiblingProduct` (idempotent)."""
        self.fused = True
        if not self.products:
            for members in sibling_groups(root, self.linears):
                product = SiblingProduct(members)
                for index, member in enumerate(members):
                    self.linears[id(member)].siblings = (product, index)
                self.products.append(product)
            self.generation += 1
        return self.products

    def drop_stale(self, memo: FingerprintMemo | None = None) -> int:
        """Drop every copy made from content its weight no longer has; returns how many layers
        (and sibling products) had one."""
        memo = {} if memo is None else memo
        dropped = sum(bound.copies.drop_stale(bound.module.weight, memo) for bound in self.linears.values())
        dropped += sum(product.copies.drop_stale(product.shape, memo) for product in self.products)
        self.generation += bool(dropped)
        return dropped

    def enter(self) -> None:
        with _WEAR_LOCK:
            self._users += 1
            if self._users > 1:
                return
            self._worn = [bound.module for bound in self.linears.values() if type(bound.module) is nn.Linear]
            for module in self._worn:
                _LIVE[id(module)] = self.linears[id(module)]
                _wear(module, PackedLinear)

    def exit(self) -> None:
        with _WEAR_LOCK:
            self._users -= 1
            if self._users > 0:
                return
            for module in self._worn:
                if type(module) is PackedLinear:
                    _wear(module, nn.Linear)
                _LIVE.pop(id(module), None)
            self._worn = []


#: root module → its binding; an entry goes with its module (a binding holds the root's layers,
#: which hold no reference back to it)
_BINDINGS: "weakref.WeakKeyDictionary[nn.Module, Binding]" = weakref.WeakKeyDictionary()


def binding(root: nn.Module) -> Binding | None:
    """The binding :func:`use_packed_linears` made for ``root`` (None: not bound)."""
    return _BINDINGS.get(root)


def use_packed_linears(module: nn.Module) -> int:
    """Bind every plain ``nn.Linear`` below ``module`` (:class:`Binding`: copies kept beside the
    module, nothing in it changes; idempotent). Returns how many layers are bound (0 where no
    dtype packs here)."""
    if not any(packing_available(dtype) for dtype in PACKED_DTYPES):
        return 0
    found = _BINDINGS.get(module)
    if found is None:
        found = _BINDINGS[module] = Binding()
    found.rescan(module)
    return len(found.linears)


def refresh_linears(module: nn.Module, memo: FingerprintMemo | None = None) -> bool:
    """Before a decoding call: follow ``module``'s layers as they are now and drop every copy of
    a weight whose content changed since it was made. Returns whether the layout changed (new
    shapes may need measuring)."""
    found = _BINDINGS.get(module)
    if found is None:
        return False
    changed = found.rescan(module)
    found.drop_stale(memo)
    return changed


def release_linears(module: nn.Module) -> None:
    """Forget everything bound for ``module`` (its copies go with it)."""
    _BINDINGS.pop(module, None)


@contextmanager
def packed_linears(active: bool = True) -> Iterator[None]:
    """Within this block, bound layers inside an entered binding (:func:`packed_forward`) and
    the decoder's LM head take the packed path."""
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextmanager
def wearing(*roots: nn.Module | None) -> Iterator[None]:
    """The bound layers of each of ``roots`` (None and unbound ones skipped) wear
    :class:`PackedLinear` until the block ends, however it ends; the packed path itself is only
    taken where :func:`packed_linears` is active too."""
    entered: list[Binding] = []
    try:
        for root in roots:
            found = _BINDINGS.get(root) if root is not None else None
            if found is not None:
                found.enter()
                entered.append(found)
        yield
    finally:
        for found in reversed(entered):
            found.exit()


@contextmanager
def packed_forward(*roots: nn.Module | None) -> Iterator[None]:
    """The decoder's own forwards: :func:`packed_linears` active and ``roots``' layers
    :func:`wearing` the packed class."""
    with packed_linears(), wearing(*roots):
        yield


def packing_active() -> bool:
    return _ACTIVE.get()


def resolved_linears(members: tuple[nn.Linear, ...], rows: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """What :class:`PackedLinear` does when ``members`` (sibling layers, or one layer) are called
    one after another on one input of ``rows`` rows, resolved once into a function of x (rows,
    in) contiguous → each member's output: their one stacked product split, where the plan takes
    it, else each layer's own path (packed copy, few-row kernel or ``F.linear``). Call inside the
    decoder's forwards (:func:`packed_forward`); the result stands while the plan and the copies
    do (the direct body, :mod:`.direct`, remakes it when either changes)."""
    bound = [_LIVE.get(id(m)) if _ACTIVE.get() else None for m in members]
    siblings = bound[0].siblings if bound[0] is not None else None
    if (siblings is not None and len(members) > 1 and siblings[0].members == tuple(members)
            and siblings[0].pays(rows)):
        product = siblings[0]
        stacked = resolved_matmul(product.shape, product.copies, rows, product.bias())
        widths = list(product.widths)
        return _kernels(lambda x: stacked(x).split_with_sizes(widths, dim=-1),  # not Tensor.split's Python wrapper
                        (stacked,))
    alone = [_resolved_one(m, b, rows) for m, b in zip(members, bound)]
    return _kernels(lambda x: tuple(f(x) for f in alone), alone)


def _kernels(function: Callable, products: Sequence[Callable]) -> Callable:
    """``function`` with ``kernels``: per product it runs (one stacked, or one per member) what it
    multiplies through — (kind, data, scales) of the compiled library's kernels — or None where it
    runs another path (oneDNN, ``F.linear``, a bias added): what :mod:`.body_call` reads."""
    function.kernels = tuple(getattr(p, "kernel", None) for p in products)
    return function


def _resolved_one(module: nn.Linear, bound: BoundLinear | None, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    if bound is not None and packs(module.weight, rows, block_kind(bound.copies, module.weight)):
        return resolved_matmul(module.weight, bound.copies, rows, module.bias)
    return lambda x: nn.functional.linear(x, module.weight, module.bias)  # the layer's weight when called


def fuse_siblings(module: nn.Module) -> list[SiblingProduct]:
    """Give every sibling group of ``module``'s bound layers (:func:`use_packed_linears` first)
    one :class:`SiblingProduct` (idempotent). Returns the products, whose ``shape`` the plan must
    measure before they are taken."""
    found = _BINDINGS.get(module)
    return found.fuse(module) if found is not None else []
