"""The structured-output suite's cases (``structured_suite.py``): 20 pydantic schemas, each a shape a
grammar must hold (bounds, enums, nesting, arrays of objects, optional fields), and the regex, choice
and ``json_object`` cases of vLLM's ``structured_outputs`` extension."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

# ---------------------------------------------------------------------------------------------------
# The 20 schemas. Every string and array is bounded (maxLength / pattern / maxItems) so that a
# grammar-constrained random model can finish an object in a few dozen tokens.

Short = Annotated[str, Field(max_length=16)]


class Flag(BaseModel):
    """1: a single boolean."""

    present: bool


class Color(BaseModel):
    """2: a Literal enum."""

    color: Literal["red", "green", "blue", "yellow"]


class Rating(BaseModel):
    """3: an integer with inclusive bounds."""

    stars: int = Field(ge=1, le=5)


class Measurement(BaseModel):
    """4: a bounded number plus a unit enum."""

    value: float = Field(ge=0, le=100)
    unit: Literal["mm", "cm", "m"]


class Caption(BaseModel):
    """5: a string with maxLength."""

    caption: str = Field(max_length=40)


class Tags(BaseModel):
    """6: an array of short strings, 1 to 3 items."""

    tags: list[Short] = Field(min_length=1, max_length=3)


class Shape(enum.Enum):
    circle = "circle"
    square = "square"
    triangle = "triangle"


class ShapeCount(BaseModel):
    """7: a Python Enum ($ref to $defs) and a count 0..20."""

    shape: Shape
    count: int = Field(ge=0, le=20)


class Titled(BaseModel):
    """8: optional fields (``X | None``, required in strict mode)."""

    title: Short
    subtitle: Short | None = None
    year: int | None = Field(default=None, ge=1900, le=2100)


class Answer(BaseModel):
    """9: ``anyOf`` of two primitives."""

    answer: Annotated[int, Field(ge=0, le=999)] | Annotated[str, Field(max_length=10)]


class Point(BaseModel):
    x: int = Field(ge=0, le=1000)
    y: int = Field(ge=0, le=1000)


class BoundingBox(BaseModel):
    """10: nested objects (two Points)."""

    top_left: Point
    bottom_right: Point


class Leaf(BaseModel):
    name: Short
    visible: bool


class Middle(BaseModel):
    leaf: Leaf
    depth: Literal[2]


class Outer(BaseModel):
    """11: three levels of nesting and a ``const``."""

    inner: Middle
    level: Literal["top"]


class Detection(BaseModel):
    label: Literal["person", "car", "dog", "cat", "tree"]
    confidence: float = Field(ge=0, le=1)


class Detections(BaseModel):
    """12: a list of objects, 0 to 3."""

    detections: list[Detection] = Field(max_length=3)


class LineItem(BaseModel):
    name: Short
    quantity: int = Field(ge=1, le=99)
    unit_price: float = Field(ge=0, le=10000)


class Receipt(BaseModel):
    """13: a receipt-like extraction: patterned date, line items, total, currency enum."""

    merchant: Annotated[str, Field(max_length=24)]
    date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
    items: list[LineItem] = Field(min_length=1, max_length=3)
    total: float = Field(ge=0, le=100000)
    currency: Literal["USD", "EUR", "GBP"]


class Product(BaseModel):
    """14: strings with ``pattern``."""

    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Circle(BaseModel):
    kind: Literal["circle"]
    radius: int = Field(ge=1, le=100)


class Rect(BaseModel):
    kind: Literal["rect"]
    width: int = Field(ge=1, le=100)
    height: int = Field(ge=1, le=100)


class Drawing(BaseModel):
    """15: ``anyOf`` of two object types (a union of models)."""

    figure: Circle | Rect


class Grid(BaseModel):
    """16: an array of arrays with exact lengths (2x2 digits)."""

    grid: list[Annotated[list[Annotated[int, Field(ge=0, le=9)]], Field(min_length=2, max_length=2)]] = Field(
        min_length=2, max_length=2
    )


class Contact(BaseModel):
    """17: a person: bounded age, optional patterned phone, optional nested Point."""

    name: Short
    age: int = Field(ge=0, le=120)
    phone: Annotated[str, Field(pattern=r"^\+?[0-9]{7,12}$")] | None = None
    location: Point | None = None


class ImageQuality(BaseModel):
    """18: several booleans and a byte-range integer."""

    blurry: bool
    dark: bool
    has_text: bool
    has_faces: bool
    brightness: int = Field(ge=0, le=255)


class Palette(BaseModel):
    """19: an array of enums, 1 to 4 items."""

    colors: list[Literal["red", "green", "blue", "black", "white"]] = Field(min_length=1, max_length=4)


class Reading(BaseModel):
    """20: negative and exclusive bounds, integer and number."""

    temperature_c: int = Field(gt=-50, lt=60)
    delta: float = Field(ge=-1, le=1)
    trend: Literal["up", "down", "flat"]


SCHEMAS: list[type[BaseModel]] = [
    Flag,
    Color,
    Rating,
    Measurement,
    Caption,
    Tags,
    ShapeCount,
    Titled,
    Answer,
    BoundingBox,
    Outer,
    Detections,
    Receipt,
    Product,
    Drawing,
    Grid,
    Contact,
    ImageQuality,
    Palette,
    Reading,
]

# (name, regex) and (name, choices): vLLM's ``structured_outputs`` extension.
REGEX_CASES: list[tuple[str, str]] = [
    ("regex:phone", r"[0-9]{3}-[0-9]{4}"),
    ("regex:yes_no", r"(yes|no)"),
    ("regex:email", r"[a-z]{3,8}@[a-z]{3,6}\.com"),
]
CHOICE_CASES: list[tuple[str, list[str]]] = [
    ("choice:animal", ["cat", "dog", "bird"]),
    ("choice:sentiment", ["positive", "negative", "neutral"]),
]
JSON_OBJECT_CASE = "json_object"
