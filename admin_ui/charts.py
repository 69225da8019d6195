"""The console's charts (Altair, drawn by ``st.altair_chart``): readable axes instead of Streamlit's
defaults, which label an all-zero series ``0.000000`` and a time axis with bare milliseconds
(``.500``). Times are UTC clock times (``12:55:37``), values plain numbers (``1.2k``), the value
axis starts at 0 and never collapses to a single tick."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st


def _top(values: list[float], floor: float = 1.0) -> float:
    """The value axis' top: 10% above the largest value, at least ``floor`` (so an all-zero
    series still gets a readable axis)."""
    return max(floor, 1.1 * max(values, default=0.0))


def lines(
    rows: list[dict],
    series: dict[str, str],
    y_title: str,
    y_format: str = "~s",
    floor: float = 1.0,
    whole: bool = False,
) -> None:
    """One line per ``series`` (column -> legend name) over ``rows[i]["at"]`` (naive UTC); the
    value axis reaches at least ``floor``; ``whole``: counts, so no fractional ticks."""
    long = [
        {"at": r["at"].isoformat() + "Z", "series": name, "value": r[col]}
        for r in rows
        for col, name in series.items()
        if r[col] is not None
    ]
    values = [float(x["value"]) for x in long]
    chart = (
        alt.Chart(pd.DataFrame(long, columns=["at", "series", "value"]))
        .mark_line(point=len(rows) < 3)
        .encode(
            x=alt.X(
                "at:T",
                title="UTC",
                scale=alt.Scale(type="utc"),
                # labelExpr: Streamlit's Vega build ignored axis.format on a time axis (":28")
                axis=alt.Axis(
                    labelExpr="utcFormat(datum.value, '%H:%M:%S')", labelAngle=0, tickCount=4
                ),
            ),
            y=alt.Y(
                "value:Q",
                title=y_title,
                scale=alt.Scale(domain=[0, _top(values, floor)]),
                axis=(
                    alt.Axis(format=y_format, tickCount=4, tickMinStep=1)
                    if whole
                    else alt.Axis(format=y_format, tickCount=4)
                ),
            ),
            color=alt.Color("series:N", title=None, legend=alt.Legend(orient="bottom")),
            tooltip=[
                alt.Tooltip("at:T", title="UTC", format="%H:%M:%S", formatType="utc"),
                alt.Tooltip("series:N", title="series"),
                alt.Tooltip("value:Q", title=y_title, format=",.2f"),
            ],
        )
        .properties(height=220)
    )
    st.altair_chart(chart, width="stretch")


def day_bars(rows: list[dict], series: dict[str, str], y_title: str) -> None:
    """Side-by-side bars per day (``rows[i]["Day"]``, every day of the range present)."""
    long = [
        {"Day": r["Day"], "series": name, "value": r[col]}
        for r in rows
        for col, name in series.items()
    ]
    values = [float(x["value"]) for x in long]
    chart = (
        alt.Chart(pd.DataFrame(long, columns=["Day", "series", "value"]))
        .mark_bar()
        .encode(
            x=alt.X("Day:O", title=None, axis=alt.Axis(labelAngle=0)),
            xOffset="series:N",
            y=alt.Y(
                "value:Q",
                title=y_title,
                scale=alt.Scale(domain=[0, _top(values)]),
                axis=alt.Axis(format="~s", tickCount=4),
            ),
            color=alt.Color("series:N", title=None, legend=alt.Legend(orient="bottom")),
            tooltip=["Day:O", "series:N", alt.Tooltip("value:Q", format=",")],
        )
        .properties(height=240)
    )
    st.altair_chart(chart, width="stretch")
