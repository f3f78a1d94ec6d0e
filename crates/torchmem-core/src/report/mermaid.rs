//! The journey diagram (`torchmem report --format mermaid`): a Mermaid `journey` whose scores reflect memory
//! pressure at each stage (see `journey::render_mermaid`).

use crate::analysis::Summary;
use crate::journey;
use crate::model::Profile;

/// The diagram's title: "Memory journey of <program>" (the script name when the command runs Python).
pub fn title(profile: &Profile) -> String {
    let cmd = &profile.meta.command;
    let program = cmd
        .iter()
        .find(|a| a.ends_with(".py"))
        .or_else(|| cmd.first())
        .map(|a| a.rsplit('/').next().unwrap_or(a).to_string());
    match program {
        Some(p) if !p.is_empty() => format!("Memory journey of {p}"),
        _ => "Memory journey".into(),
    }
}

/// The Mermaid source.
pub fn render(profile: &Profile, summary: &Summary) -> String {
    journey::render_mermaid(&summary.journey, &title(profile))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RunMeta;

    #[test]
    fn title_names_the_script() {
        let mut p = Profile {
            meta: RunMeta {
                command: vec!["/venv/bin/python".into(), "/home/u/train.py".into(), "--lr".into()],
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(title(&p), "Memory journey of train.py");
        p.meta.command = vec!["/bin/sleep".into(), "1".into()];
        assert_eq!(title(&p), "Memory journey of sleep");
        p.meta.command.clear();
        assert_eq!(title(&p), "Memory journey");
    }
}
