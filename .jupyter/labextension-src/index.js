// The course's Lab modes, the one piece JupyterLab's own settings cannot express:
// nbgrader's Validate button on every notebook makes a learner "validate" START_HERE or a
// chapter, which has nothing to check. nbgrader adds the button to every notebook toolbar,
// so this hides it (a CSS class) on notebooks with no nbgrader cell, i.e. anything that is
// not an assignment, wherever it lies (exercises/ locally, ~/ASSIGNMENT on the hub).
// Disabled in the instructor's Lab by page_config (.jupyter/roles/instructor).

const HIDDEN = 'ts-validate-hidden';

function isAssignment(model) {
  const cells = model.cells;
  for (let i = 0; i < cells.length; i++) {
    if (cells.get(i).getMetadata('nbgrader')) {
      return true;
    }
  }
  return false;
}

const plugin = {
  id: '@tinyserve/course-modes:validate-in-assignments',
  description: 'Shows nbgrader\'s Validate button only on assignment notebooks.',
  autoStart: true,
  activate: app => {
    app.docRegistry.addWidgetExtension('Notebook', {
      createNew(panel, context) {
        // Hidden until the notebook is read, so it never flashes on a chapter.
        panel.addClass(HIDDEN);
        context.ready.then(() => {
          if (isAssignment(context.model)) {
            panel.removeClass(HIDDEN);
          }
        });
      }
    });
  }
};

module.exports = plugin;
