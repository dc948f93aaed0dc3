//! Progress for long host work (drawing or loading a real model's weights, CPU reference
//! steps): a bar or spinner on stderr, drawn only when stderr is a terminal, so pipes,
//! logs and tests see exactly the text they saw before.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::time::Duration;

/// Work smaller than this finishes before a display would help.
const SHOW_ABOVE_ELEMENTS: u64 = 100_000_000;

/// A bar over `total` elements, shown for real-model sizes only.
pub fn elements(total: u64, what: &str) -> ProgressBar {
    if total < SHOW_ABOVE_ELEMENTS {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {percent:>3}% {human_pos}/{human_len} ({elapsed}, {eta} left)",
        )
        .expect("the template is valid")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

/// A spinner saying what runs now, with the time it has taken so far.
pub fn spinner(what: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("the template is valid"),
    );
    bar.set_message(what.to_string());
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}
